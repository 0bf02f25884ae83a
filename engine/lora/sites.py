"""Where adapters change the model: every adaptable linear's resident LoRA weights, and the
batched product that adds each row's own adapter to the linear's output.

Each site (a linear an adapter may target) keeps the resident adapters stacked by slot:
A [S, R, in] and B transposed, Bt [S, R, out] (times the scaling), rank padded to `lora.max_rank`
with zeros, and zeros in every slot whose adapter leaves the linear alone. A step's rows carry their
slot (-1: the base model), so one forward serves requests of several adapters and the base together,
each row reading only its own adapter's weights:

- on the CPU the C kernel (kernels/cpu/lora_rows.c): one call per hooked module (a linear, or the
  FusedLinears group of linears of one input), each row its slot's A then Bt, each delta added into
  the module's output in place;
- on CUDA the Triton kernel (kernels/triton_lora.py), one call per linear;
- elsewhere (or where the C kernel is not built) torch: a step whose rows all have one adapter runs
  that adapter's rank-r pair; a mix runs two GEMMs over the first n slots side by side (n one past
  the highest slot in the step): v = x @ A[:n]^T [T, n*R], each row's columns of other slots
  zeroed, delta = v @ Bt[:n] — one rank-n*R product whatever the mix, no loop per adapter.

The product runs as a forward hook on the linear's module (or on the FusedLinears that runs a
group of them, engine/model/cpu_linear.py), so the base linear runs as it did, on whatever path
it was given, and the checkpoint's parameter names stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.lora.adapter import LinearShape, LoraAdapter, read_adapter
from kernels.select import kernels_for

ADAPTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # lora.dtype besides auto

# The linears an adapter may change, by the name their module has in its layer (PEFT's target_modules).
ADAPTABLE = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                       "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj"})


@dataclass(slots=True)
class LoraStep:
    """The rows of one forward pass and their adapter slots."""

    slots: torch.Tensor  # [T] int64 on the model's device, -1: the base model
    used: frozenset[int]  # the slots some row has
    bits: int  # the same, bit s for slot s
    single: int | None  # the one slot every row has, if so
    width: int  # one past the highest slot used
    rank: int  # R, the padded rank
    _mask: torch.Tensor | None = None

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[T, width*R]: 1 where a column belongs to the row's own slot."""
        if self._mask is None or self._mask.dtype != dtype:
            owner = torch.arange(self.width, device=self.slots.device).repeat_interleave(self.rank)
            self._mask = (owner[None, :] == self.slots[:, None]).to(dtype)
        return self._mask


@dataclass(slots=True)
class LoraSite:
    """One adaptable linear's resident adapters."""

    name: str
    a: torch.Tensor  # [S, R, in]
    bt: torch.Tensor  # [S, R, out]: B transposed, times the scaling
    ranks: list[int]  # per slot: its adapter's rank here (0: the adapter leaves this linear alone)
    kernel: Callable[..., torch.Tensor | None] | None = None  # the device's batched product (kernels/select.py)
    bits: int = 0  # bit s: slot s's adapter changes this linear
    # The first n slots' views, made once per n (the storage is written in place: they stay valid).
    _views: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n slots: a [n, R, in] and b [out, n, R] (the kernels' layout names B untransposed)."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (self.a[:n], self.bt[:n].permute(2, 0, 1))
        return views

    def delta(self, x: torch.Tensor, step: LoraStep) -> torch.Tensor | None:
        """What the step's adapters add to this linear's output for rows x [T, in]; None: nothing.
        A hook calls it for every adapted linear of every forward: kept to attribute reads."""
        if not self.bits & step.bits:
            return None
        n = step.width
        views = self.views(n)
        if self.kernel is not None:
            found = self.kernel(x, views[0], views[1], step.slots)
            if found is not None:
                return found
        if step.single is not None:
            s, r = step.single, self.ranks[step.single]
            return (x @ self.a[s, :r].to(x.dtype).T) @ self.bt[s, :r].to(x.dtype)
        v = x @ self.a[:n].reshape(n * step.rank, -1).to(x.dtype).T
        v = v * step.mask(v.dtype)
        return v @ self.bt[:n].reshape(n * step.rank, -1).to(x.dtype)


@dataclass
class LoraSites:
    """Every adaptable linear of a model, the adapters resident in its slots, and the step running."""

    sites: dict[str, LoraSite]
    max_rank: int
    dtype: torch.dtype  # the adapters' weights as held and run (lora.dtype)
    step: LoraStep | None = None
    slot_adapters: list[LoraAdapter | None] = field(default_factory=list)
    # the CPU's in-place product, prepared for a module's sites (kernels/select.py's lora_add); None: per site
    prepare_add: Callable[..., Callable[..., bool] | None] | None = None

    @classmethod
    def install(cls, model: nn.Module, slots: int, max_rank: int, weights: str = "auto") -> LoraSites:
        """Sites for every adaptable linear of `model`, each with `slots` empty slots, and the hooks
        that add the step's adapters to their outputs; `weights` (lora.dtype): the adapters' dtype, auto
        for the model's."""
        linears = adaptable_linears(model)
        param = next(model.parameters())
        if weights == "auto":
            # the compute dtype (lm_head's): an fp8 checkpoint's linears hold fp8 weights, its activations are not
            dtype = getattr(model, "dtype", param.dtype)
            if not dtype.is_floating_point or dtype.itemsize < 2:
                dtype = torch.float32
        elif weights in ADAPTER_DTYPES:
            dtype = ADAPTER_DTYPES[weights]
        else:
            raise ValueError(f"lora.dtype must be auto, {', '.join(ADAPTER_DTYPES)}, got {weights!r}")
        kernel = kernels_for(param.device).lora_delta
        sites = {name: LoraSite(name, torch.zeros(slots, max_rank, shape.in_features, dtype=dtype, device=param.device),
                                torch.zeros(slots, max_rank, shape.out_features, dtype=dtype, device=param.device),
                                [0] * slots, kernel)
                 for name, (_, shape) in linears.items()}
        self = cls(sites, max_rank, dtype, slot_adapters=[None] * slots, prepare_add=kernels_for(param.device).lora_add)
        self._hook(model)
        return self

    def read(self, path: str | Path) -> LoraAdapter:
        """The adapter in folder `path`, checked against these linears and rounded to their dtype
        (AdapterError when it cannot be served here)."""
        return read_adapter(path, self.targets, self.max_rank, self.dtype)

    @property
    def targets(self) -> dict[str, LinearShape]:
        return {name: LinearShape(site.a.shape[2], site.bt.shape[2]) for name, site in self.sites.items()}

    @property
    def num_slots(self) -> int:
        return len(self.slot_adapters)

    def place(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into `slot` (between steps: a step reads these tensors)."""
        for name, site in self.sites.items():
            site.a[slot].zero_()
            site.bt[slot].zero_()
            site.ranks[slot] = 0
            site.bits &= ~(1 << slot)
            linear = adapter.linears.get(name)
            if linear is None:
                continue
            r = linear.rank
            site.a[slot, :r].copy_(linear.a)
            site.bt[slot, :r].copy_(linear.b.T)
            site.ranks[slot] = r
            site.bits |= 1 << slot
        self.slot_adapters[slot] = adapter

    def begin(self, row_slots: Sequence[int], device: torch.device) -> None:
        """The next forward's rows have these slots (-1: the base model)."""
        used = frozenset(row_slots) - {-1}
        if not used:
            self.step = None
            return
        single = next(iter(used)) if len(used) == 1 and -1 not in row_slots else None
        self.step = LoraStep(torch.tensor(row_slots, dtype=torch.int64, device=device), used,
                             sum(1 << s for s in used), single, max(used) + 1, self.max_rank)

    def end(self) -> None:
        self.step = None

    def _hook(self, model: nn.Module) -> None:
        hooked: set[int] = set()
        prefix = {id(module): name for name, module in model.named_modules()}
        for module in list(model.modules()):
            base = prefix[id(module)]
            for attribute, names in getattr(module, "fusible_linears", {}).items():
                fused = getattr(module, attribute, None)
                members = [self.sites.get(f"{base}.{name}") for name in names]
                if isinstance(fused, nn.Module) and any(members):
                    fused.register_forward_hook(self._group_hook(members))
                    hooked.update(id(getattr(module, name)) for name in names)
        for name, module in model.named_modules():
            if name in self.sites and id(module) not in hooked:
                module.register_forward_hook(self._linear_hook(self.sites[name]))

    def _prepared(self, cache: dict[tuple[int, int], Callable[..., bool] | None], members: Sequence[LoraSite],
                  width: int, which: int) -> Callable[..., bool] | None:
        """The in-place call for `members` over the first `width` slots (None: they run per site), made once
        per (width, which: the members the step's adapters change, bit i for members[i])."""
        key = (width, which)
        if key not in cache:
            cache[key] = None if self.prepare_add is None else \
                self.prepare_add([site.views(width) for site in members])
        return cache[key]

    def _linear_hook(self, site: LoraSite) -> Callable[..., torch.Tensor | None]:
        prepared: dict[tuple[int, int], Callable[..., bool] | None] = {}

        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
            step = self.step
            if step is None or not site.bits & step.bits:
                return None
            add = self._prepared(prepared, (site,), step.width, 1)
            if add is not None and add(args[0], (out,), step.slots):
                return None  # added into the linear's own fresh output
            delta = site.delta(args[0], step)
            return None if delta is None else out.add_(delta)
        return hook

    def _group_hook(self, members: list[LoraSite | None]) -> Callable[..., tuple[torch.Tensor, ...] | None]:
        prepared: dict[tuple[int, int], Callable[..., bool] | None] = {}

        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...]
                 ) -> tuple[torch.Tensor, ...] | None:
            step = self.step
            if step is None:
                return None
            x = args[0]
            # one C call for the members the step changes, into the outputs (views of the call's own)
            hit = [(i, site) for i, site in enumerate(members) if site is not None and site.bits & step.bits]
            if not hit:
                return None
            add = self._prepared(prepared, [site for _, site in hit], step.width, sum(1 << i for i, _ in hit))
            if add is not None and add(x, [outs[i] for i, _ in hit], step.slots):
                return None
            changed = []
            for out, site in zip(outs, members):
                delta = None if site is None else site.delta(x, step)
                changed.append(out if delta is None else out.add_(delta))  # views of the call's fresh output
            return tuple(changed)
        return hook


def adaptable_linears(model: nn.Module) -> dict[str, tuple[nn.Module, LinearShape]]:
    """The model's linears an adapter may change, by module path, with their shapes (whatever path
    runs them: nn.Linear, oneDNN's, fp8's; each keeps in_features and out_features)."""
    found: dict[str, tuple[nn.Module, LinearShape]] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ADAPTABLE and hasattr(module, "in_features") and hasattr(module, "out_features"):
            found[name] = (module, LinearShape(int(module.in_features), int(module.out_features)))
    return found
