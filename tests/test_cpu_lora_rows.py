"""The CPU's batched multi-adapter LoRA product (kernels/cpu/lora_rows.c) against its oracle,
kernels/lora.py's lora_delta_reference, given the same b view: 0-33 rows, 1-8 slots of rank 4 or 16,
`in` and `out` past the 16-lane and 64-column blocks (in=72, out=200) and model-sized once, rows mixing
-1 and several slots (one slot, none), 33 rows of one slot (two pieces of 32), strided rows, and a
prefix of the resident slots whose other slots are NaN (a read past the prefix shows). Slots out of
range raise; layouts C does not take return None. The same on the builds another CPU's `make kernels`
makes (AVX2, SSE2 only: the GNU vector types split), built here with gcc.

lora_rows_add (load_add): several linears of the same rows in one call, each delta added into its
output, those outputs column slices of one fused buffer as a FusedLinears gives them: equal to the
output plus the reference's delta, bit for bit to the single-linear kernel's output added in torch;
with the adapters' weights in bfloat16 (lora.dtype=bfloat16), equal to the reference reading the same
bf16 values in fp32.

Tolerance: the same fp32 products summed in another order (16 lanes over `in`, then over R) than the
reference's bmm: ~1e-6 relative at deltas ~1, so 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from cpu_kernels import build_for, built_kernel
from kernels import select
from kernels.cpu import lora_rows
from kernels.cpu.lora_rows import LoraDelta
from kernels.lora import lora_delta_reference

TOL = 1e-5


@pytest.fixture(scope="module")
def kernel() -> LoraDelta:
    return built_kernel(lora_rows.load)


BUILDS = {"avx2": ["-march=x86-64-v3"], "portable": ["-march=x86-64"]}


# (x, [(a, b) of each linear], [each linear's output], slots) -> whether C added the deltas
LoraAdd = Callable[[torch.Tensor, Sequence[tuple[torch.Tensor, torch.Tensor]], Sequence[torch.Tensor], torch.Tensor],
                   bool]


def prepared_and_called(prepare: Callable[..., Any]) -> LoraAdd:
    """load_add's two halves in one call, as a hook uses them: prepare for the sites, then run (False where
    either refuses)."""
    def add(x: torch.Tensor, sites: Sequence[tuple[torch.Tensor, torch.Tensor]], outs: Sequence[torch.Tensor],
            slots: torch.Tensor) -> bool:
        call = prepare(sites)
        return call is not None and bool(call(x, outs, slots))
    return add


@pytest.fixture(scope="module")
def adder() -> LoraAdd:
    return prepared_and_called(built_kernel(lora_rows.load_add))


@pytest.fixture(scope="module", params=sorted(BUILDS))
def portable_build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The library as another CPU's `make kernels` builds it (gcc here, for each of BUILDS)."""
    return build_for("lora_rows.c", BUILDS[request.param], tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def portable(portable_build: Path) -> LoraDelta:
    fn = lora_rows.load(portable_build)
    assert fn is not None
    return fn


class Lora(NamedTuple):
    x: torch.Tensor  # [T, in], rows `in + pad` floats apart
    a: torch.Tensor  # [S, R, in]: the first S of s_max slots
    b: torch.Tensor  # [out, S, R]: bt[:S].permute(2, 0, 1) of a contiguous bt [s_max, R, out]
    slots: torch.Tensor  # int64 [T], -1 = no adapter


def make_lora(slots: list[int], s: int, rank: int, hidden: int = 72, n_out: int = 200, s_max: int | None = None,
              pad: int = 0, seed: int = 0) -> Lora:
    """Random adapters (deltas ~1) in the first s of s_max slots, slot 1 (if any) of real rank
    rank // 2 (zero rows of A and B); the slots past s are NaN."""
    s_max = s if s_max is None else s_max
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(len(slots), hidden + pad + 3, generator=g)
    a = torch.full((s_max, rank, hidden), float("nan"))
    bt = torch.full((s_max, rank, n_out), float("nan"))
    a[:s] = torch.randn(s, rank, hidden, generator=g) * hidden**-0.5
    bt[:s] = torch.randn(s, rank, n_out, generator=g) * rank**-0.5
    if s > 1:
        a[1, rank // 2:] = 0
        bt[1, rank // 2:] = 0
    return Lora(wide[:, 3:3 + hidden], a[:s], bt.permute(2, 0, 1)[:, :s], torch.tensor(slots, dtype=torch.int64))


def check(fn: LoraDelta, lora: Lora) -> None:
    got = fn(*lora)
    assert got is not None
    assert got.shape == (lora.x.shape[0], lora.b.shape[0]) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, lora_delta_reference(*lora), rtol=TOL, atol=TOL)


def mixed_slots(t: int, s: int) -> list[int]:
    """-1 and the slots, in no order (T=8 at S=8: 1, 6, 2, 7, 3, -1, 4, 0)."""
    return [(5 * i + 2) % (s + 1) - 1 for i in range(t)]


@pytest.mark.parametrize("rank", [4, 16])
@pytest.mark.parametrize("s", [1, 3, 8])
@pytest.mark.parametrize("t", [0, 1, 3, 8, 33])
def test_mixed_slots_against_the_reference(kernel: LoraDelta, t: int, s: int, rank: int) -> None:
    check(kernel, make_lora(mixed_slots(t, s), s, rank, seed=t * 100 + s * 10 + rank))


@pytest.mark.parametrize("t", [1, 3, 8, 33])
def test_one_slot_and_no_slot(kernel: LoraDelta, t: int) -> None:
    """Every row one slot (33: two pieces of 32 rows, tiles of 4 and a remainder), and none at all."""
    check(kernel, make_lora([2] * t, 3, 16, seed=t))
    none = make_lora([-1] * t, 3, 16, seed=t)
    got = kernel(*none)
    assert got is not None and torch.equal(got, torch.zeros(t, 200))


def test_a_model_sized_product(kernel: LoraDelta) -> None:
    """in=1024, out=4096, 8 slots of 16: the threads split the columns, the prefetch runs into the next slot."""
    check(kernel, make_lora([0, 5, -1, 5, 7, 3, 0, 2], 8, 16, hidden=1024, n_out=4096, seed=1))


@pytest.mark.parametrize(("hidden", "n_out"), [(1, 1), (7, 5), (16, 64), (17, 65), (33, 130)])
def test_sizes_around_the_blocks(kernel: LoraDelta, hidden: int, n_out: int) -> None:
    for t in (1, 9, 40):
        check(kernel, make_lora(mixed_slots(t, 3), 3, 16, hidden=hidden, n_out=n_out, seed=t))


def test_strided_rows_and_a_prefix_of_the_slots(kernel: LoraDelta) -> None:
    """Rows 72 + 29 + 3 floats apart; a[:3] and b[:, :3] of 8 slots whose last 5 are NaN."""
    for t in (1, 8, 33):
        check(kernel, make_lora(mixed_slots(t, 3), 3, 16, s_max=8, pad=29, seed=t))
    lora = make_lora([0], 2, 4)
    check(kernel, lora._replace(x=lora.x.expand(5, -1), slots=torch.tensor([0, -1, 1, 1, 0])))  # row stride 0


def test_each_row_reads_its_own_slot(kernel: LoraDelta) -> None:
    """Rows with the same x through different slots differ as their slots' products do."""
    lora = make_lora([0, 1, 2, -1], 3, 16, s_max=5)
    x = lora.x[:1].expand(4, -1).contiguous()
    got = kernel(x, lora.a, lora.b, lora.slots)
    assert got is not None
    for t, s in enumerate([0, 1, 2]):
        want = lora.b[:, s, :] @ (lora.a[s] @ x[t])
        torch.testing.assert_close(got[t], want, rtol=TOL, atol=TOL)
    assert torch.equal(got[3], torch.zeros(200))


def test_the_portable_builds(portable: LoraDelta) -> None:
    for t in (1, 8, 33):
        check(portable, make_lora(mixed_slots(t, 3), 3, 16, s_max=4, pad=5, seed=t))
    check(portable, make_lora([0, 5, -1, 5, 7, 3, 0, 2], 8, 16, hidden=1024, n_out=4096, seed=1))


def test_a_slot_out_of_range_raises(kernel: LoraDelta) -> None:
    lora = make_lora([0, 1, 2], 3, 4)
    for bad in ([0, 3, 1], [0, -2, 1]):
        with pytest.raises(ValueError, match=r"slots must be in \[-1, 3\)"):
            kernel(lora.x, lora.a, lora.b, torch.tensor(bad))


def test_layouts_it_does_not_take_return_none(kernel: LoraDelta) -> None:
    """None where C would need a copy: the caller runs its torch path."""
    x, a, b, slots = make_lora([0, -1, 1], 2, 4)
    refused = {
        "b contiguous [out, S, R]": (x, a, b.contiguous(), slots),
        "a not contiguous": (x, a.transpose(1, 2).contiguous().transpose(1, 2), b, slots),
        "x columns strided": (torch.randn(3, 2 * 72)[:, ::2], a, b, slots),
        "x float64": (x.double(), a, b, slots),
        "x bfloat16": (x.bfloat16(), a, b, slots),
        "b float64": (x, a, b.double(), slots),
        "slots int32": (x, a, b, slots.int()),
        "slots strided": (x, a, b, torch.tensor([0, 0, -1, 0, 1, 0])[::2]),
    }
    for what, operands in refused.items():
        assert kernel(*operands) is None, what


def test_cpu_kernels_run_it_unless_told_to_run_the_references(kernel: LoraDelta,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    lora = make_lora([1, -1, 0], 2, 4)
    chosen = select.cpu_kernels().lora_delta
    assert chosen is not None
    torch.testing.assert_close(chosen(*lora), lora_delta_reference(*lora), rtol=TOL, atol=TOL)
    monkeypatch.setenv("IGNIS_CPU_KERNELS", "reference")
    assert select.cpu_kernels().lora_delta is None


def fused_sites(slots: list[int], s: int, rank: int, outs: list[int], hidden: int = 72, s_max: int | None = None,
                seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor,
                                        list[torch.Tensor], torch.Tensor]:
    """x, each site's (a, b) in `dtype` (b a view of a contiguous bt as a site holds it), the slots, and each
    site's output: column slices of one [T, sum(outs) + 5] buffer of random values (a fused linear's output)."""
    loras = [make_lora(slots, s, rank, hidden=hidden, n_out=n, s_max=s_max, seed=seed + i) for i, n in enumerate(outs)]
    x = loras[0].x
    fused = torch.randn(len(slots), sum(outs) + 5, generator=torch.Generator().manual_seed(seed))
    views, at = [], 0
    for n in outs:
        views.append(fused[:, at:at + n])
        at += n
    sites = [(lora.a.to(dtype), lora.b.permute(1, 2, 0).to(dtype).contiguous().permute(2, 0, 1)) for lora in loras]
    return x, sites, loras[0].slots, views, fused


def check_add(fn: LoraAdd, slots: list[int], s: int, rank: int, outs: list[int], **kwargs: Any) -> None:
    x, sites, slot_ids, views, fused = fused_sites(slots, s, rank, outs, **kwargs)
    want = [view + lora_delta_reference(x, a, b, slot_ids) for (a, b), view in zip(sites, views)]
    before = fused.clone()
    assert fn(x, sites, views, slot_ids)
    for got, expected in zip(views, want):
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
    assert torch.equal(fused[:, sum(outs):], before[:, sum(outs):])  # the columns past the sites untouched


WEIGHTS = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", WEIGHTS)
@pytest.mark.parametrize("rank", [4, 16])
@pytest.mark.parametrize("t", [0, 1, 3, 8, 33])
def test_several_linears_added_in_place(adder: LoraAdd, t: int, rank: int, dtype: torch.dtype) -> None:
    """q/k/v-like sites of different widths (past the 64-column blocks and not), mixed slots and -1."""
    check_add(adder, mixed_slots(t, 3), 3, rank, [200, 72, 72], s_max=8, seed=t * 10 + rank, dtype=dtype)
    check_add(adder, [1] * t, 2, rank, [130], seed=t, dtype=dtype)


@pytest.mark.parametrize("dtype", WEIGHTS)
def test_a_model_sized_group_added_in_place(adder: LoraAdd, dtype: torch.dtype) -> None:
    """A layer's gate and up at in=1024, out=3072, 8 slots of 16, one row each and a base row."""
    check_add(adder, [0, 5, -1, 5, 7, 3, 0, 2], 8, 16, [3072, 3072], hidden=1024, seed=3, dtype=dtype)


@pytest.mark.parametrize("slots", [mixed_slots(9, 3), [0, 2, -1, 1]], ids=["several rows a slot", "one row a slot"])
def test_bfloat16_weights_are_read_as_their_exact_values(adder: LoraAdd, slots: list[int]) -> None:
    """The delta of bf16 weights equals the fp32 kernel's on those weights widened (the same products),
    whether they are widened into a buffer (several rows of a slot) or as read (one)."""
    x, sites, slot_ids, views, _ = fused_sites(slots, 3, 16, [200, 72], seed=7, dtype=torch.bfloat16)
    widened = [(a.float(), b.permute(1, 2, 0).float().contiguous().permute(2, 0, 1)) for a, b in sites]
    want = [view.clone() for view in views]
    assert adder(x, widened, want, slot_ids)
    assert adder(x, sites, views, slot_ids)
    for got, expected in zip(views, want):
        assert torch.equal(got, expected)


def test_adding_equals_the_delta_added_in_torch(adder: LoraAdd, kernel: LoraDelta) -> None:
    """Bit for bit: what the hook did before (the single-linear kernel's delta, then out.add_)."""
    x, sites, slot_ids, views, _ = fused_sites(mixed_slots(8, 3), 3, 16, [200, 72], seed=5)
    want = []
    for (a, b), view in zip(sites, views):
        delta = kernel(x, a, b, slot_ids)
        assert delta is not None
        want.append(view + delta)
    assert adder(x, sites, views, slot_ids)
    for got, expected in zip(views, want):
        assert torch.equal(got, expected)


def test_rows_without_an_adapter_keep_their_output(adder: LoraAdd) -> None:
    x, sites, slot_ids, views, fused = fused_sites([-1, -1, -1], 2, 4, [72, 72])
    before = fused.clone()
    assert adder(x, sites, views, slot_ids)
    assert torch.equal(fused, before)


def test_the_portable_builds_add_in_place(portable_build: Path) -> None:
    prepare = lora_rows.load_add(portable_build)
    assert prepare is not None
    fn = prepared_and_called(prepare)
    for dtype in WEIGHTS:
        check_add(fn, mixed_slots(33, 3), 3, 16, [200, 72], s_max=4, dtype=dtype)
        check_add(fn, [0, 5, -1, 5, 7, 3, 0, 2], 8, 16, [3072, 1024], hidden=1024, seed=1, dtype=dtype)


def test_adding_refuses_what_c_does_not_take_and_writes_nothing(adder: LoraAdd) -> None:
    x, sites, slot_ids, views, fused = fused_sites([0, -1, 1], 2, 4, [72, 40])
    before = fused.clone()
    (a, b), (a2, b2) = sites
    refused = {
        "an output in bfloat16": (x, sites, [views[0], views[1].bfloat16()], slot_ids),
        "an output's columns strided": (x, sites, [views[0], torch.zeros(3, 80)[:, ::2]], slot_ids),
        "an output of the wrong width": (x, sites, [views[0], views[0]], slot_ids),
        "b contiguous": (x, [(a, b), (a2, b2.contiguous())], views, slot_ids),
        "sites of other slot counts": (x, [(a, b), (a2[:1], b2[:, :1])], views, slot_ids.clamp(max=0)),
        "x bfloat16": (x.bfloat16(), sites, views, slot_ids),
        "sites of other dtypes": (x, [(a, b), (a2.bfloat16(), b2.permute(1, 2, 0).bfloat16().contiguous().permute(2, 0, 1))],
                                  views, slot_ids),
        "a float16 site": (x, [(a.half(), b.permute(1, 2, 0).half().contiguous().permute(2, 0, 1))], views[:1], slot_ids),
    }
    for what, operands in refused.items():
        assert not adder(*operands), what
    assert torch.equal(fused, before)
    with pytest.raises(ValueError, match=r"slots must be in \[-1, 2\)"):
        adder(x, sites, views, torch.tensor([0, 2, 1]))
    assert not adder(x, sites, views[:1], slot_ids)  # an output short
    assert torch.equal(fused, before)
