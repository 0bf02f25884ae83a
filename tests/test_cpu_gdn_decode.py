"""The CPU's fused Gated DeltaNet decode step (kernels/cpu/gdn_decode.c) against its torch
references: the layer's gates, kernels/causal_conv.py's causal_conv1d, kernels/gated_delta.py's
gated_delta_decode_step_ (itself checked against the token-by-token recurrent rule) and the
layer's GatedRMSNorm, on conv taps and recurrent states laid out as the engine's DeviceCache
holds them (slots scattered, several layers per slot); then a hybrid model's decode through the
engine's layer, kernel vs references."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch.nn.functional as F

from engine.model.layers import GatedRMSNorm
from kernels.causal_conv import causal_conv1d
from kernels.cpu import gdn_decode
from kernels.gated_delta import gated_delta_decode_step_, recurrent_gated_delta_rule
from kernels.select import kernels_for
from cpu_kernels import built_kernel

# Both sides compute in fp32; only the summation order differs.
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def kernel() -> gdn_decode.FusedDecode:
    return built_kernel(gdn_decode.load)


def split(y: torch.Tensor, hk: int, hv: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    b = y.shape[0]
    return q.view(b, 1, hk, dk), k.view(b, 1, hk, dk), v.view(b, 1, hv, dv)


def check(kernel: gdn_decode.FusedDecode, batch: int, hk: int, hv: int, dk: int, dv: int, kernel_size: int,
          layers: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    channels = 2 * hk * dk + hv * dv
    slots = batch * 2 + 1
    conv_pool = torch.randn(slots, layers, channels, kernel_size - 1, generator=g)
    state_pool = torch.randn(slots, layers, hv, dk, dv, generator=g) * 0.1
    layer = layers - 1
    slot_ids = torch.randperm(slots, generator=g)[:batch].tolist()
    x = torch.randn(batch, channels, generator=g)
    weight = torch.randn(channels, kernel_size, generator=g) * 0.5
    a = torch.randn(batch, hv, generator=g) * 4  # some past softplus' threshold of 20 once shifted
    a[0, 0] = 25.0
    b = torch.randn(batch, hv, generator=g) * 2
    a_log = torch.randn(hv, generator=g) * 0.5
    dt_bias = torch.randn(hv, generator=g)
    z = torch.randn(batch, hv, dv, generator=g)
    norm = GatedRMSNorm(dv, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dv, generator=g))

    # The references, on copies of the pools: the layer's gates, the conv, the delta rule, the norm.
    beta = b.sigmoid()
    gate = -a_log.exp() * F.softplus(a + dt_bias)  # log decay <= 0
    ref_conv, ref_state = conv_pool.clone(), state_pool.clone()
    y, new_taps = causal_conv1d(x.unsqueeze(-1), weight, ref_conv[slot_ids, layer])
    q, k, v = split(y[..., 0], hk, hv, dk, dv)
    states = [ref_state[s, layer] for s in slot_ids]
    core = gated_delta_decode_step_(q, k, v, gate.unsqueeze(1), beta.unsqueeze(1), states)[:, 0]
    with torch.no_grad():
        want = norm(core.reshape(-1, dv), z.reshape(-1, dv)).view(batch, hv * dv)
    ref_conv[slot_ids, layer] = new_taps
    # The decode step agrees with the token-by-token rule too (the oracle's oracle).
    rec_out, _ = recurrent_gated_delta_rule(q, k, v, gate.unsqueeze(1), beta.unsqueeze(1),
                                            state_pool[slot_ids, layer])
    assert (rec_out[:, 0] - core).abs().max().item() < TOLERANCE

    untouched = [s for s in range(slots) if s not in slot_ids]
    before_conv, before_state = conv_pool[untouched].clone(), state_pool[untouched].clone()
    got = kernel(x, a, b, z, a_log, dt_bias, norm.weight.detach(), norm.eps, weight, conv_pool, state_pool, layer,
                 slot_ids, hk, dk, dv)
    assert got.shape == (batch, hv * dv)
    # The norm divides by the output's RMS, so compare relative to the output's scale.
    assert (got - want).abs().max().item() < TOLERANCE * max(1.0, want.abs().max().item())
    assert (conv_pool - ref_conv).abs().max().item() < TOLERANCE  # taps shifted in place, exactly
    assert (state_pool - ref_state).abs().max().item() < TOLERANCE
    # Other slots, and other layers of the same slots, are not touched.
    assert torch.equal(conv_pool[untouched], before_conv) and torch.equal(state_pool[untouched], before_state)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("hk, hv, dk, dv", [(2, 2, 16, 16), (2, 4, 32, 64), (4, 8, 128, 128), (1, 4, 64, 256)])
def test_matches_the_references(kernel: gdn_decode.FusedDecode, batch: int, hk: int, hv: int, dk: int,
                                dv: int) -> None:
    check(kernel, batch, hk, hv, dk, dv, kernel_size=4, layers=3, seed=batch * 100 + dk)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 6), hk=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4]),
       dk=st.integers(1, 40), dv=st.integers(1, 40), kernel_size=st.integers(2, 5), layers=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_random_shapes(kernel: gdn_decode.FusedDecode, batch: int, hk: int, group: int, dk: int, dv: int,
                       kernel_size: int, layers: int, seed: int) -> None:
    check(kernel, batch, hk, hk * group, dk, dv, kernel_size, layers, seed)


def test_too_large_a_head_is_refused_not_overrun(kernel: gdn_decode.FusedDecode) -> None:
    assert not gdn_decode.supports(torch.zeros(1, 1, 4, 3), torch.zeros(1, 1, 1, 512, 8), 512, 8)
    with pytest.raises(RuntimeError, match="refused"):
        check(kernel, 1, 1, 1, 300, 8, kernel_size=4, layers=1, seed=0)


def test_a_missing_library_loads_as_none(tmp_path: Path) -> None:
    assert gdn_decode.load(tmp_path / "absent.so") is None


def test_a_hybrid_model_decodes_the_same_through_the_kernel(checkpoint_dir: Callable[[str], Path],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            kernel: gdn_decode.FusedDecode) -> None:
    """The engine's GDN layers with the fused step vs with the references: same logits per step."""
    from engine.model import gated_deltanet as layer
    from engine.model.loader import load_model
    from test_model import make_cache, make_prompt, run_chunks

    table = kernels_for(torch.device("cpu"))
    assert table.gdn_decode_fused is not None  # the CPU's kernel table carries it once built
    path = checkpoint_dir("Qwen3_5ForCausalLM")
    loaded = load_model(path, onednn_linears=True)
    ids = make_prompt(40, seed=3)
    pages = list(range(4))
    calls: list[int] = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args)
    monkeypatch.setattr(layer, "kernels_for", lambda device: dataclasses.replace(table, gdn_decode_fused=counted))
    # Decodes, then short continuations (a verify's shape), stepped through the recurrence.
    sizes = [22] + [1] * 8 + [4, 6]
    fused = run_chunks(loaded, make_cache(loaded), ids, sizes, pages)
    assert len(calls) == 10 * len(loaded.config.state_shape().linear_layers)  # every decode, every GDN layer
    monkeypatch.setattr(layer, "kernels_for", lambda device: dataclasses.replace(table, gdn_decode_fused=None))
    references = run_chunks(loaded, make_cache(loaded), ids, sizes, pages)
    assert (fused - references).abs().max().item() < 1e-4


@pytest.mark.parametrize("tokens", [[1], [5], [1, 5, 3], [2, 1, 7, 1]])
def test_several_tokens_a_sequence_step_in_order(kernel: gdn_decode.FusedDecode, tokens: list[int]) -> None:
    """Sequences bringing several tokens in one call equal the same tokens one call a position (the
    one-token step is checked against the references above)."""
    g = torch.Generator().manual_seed(len(tokens) * 10 + sum(tokens))
    hk, hv, dk, dv, taps, layers = 2, 4, 32, 16, 3, 2
    channels, rows, batch = 2 * hk * dk + hv * dv, sum(tokens), len(tokens)
    conv_pool = torch.randn(batch + 2, layers, channels, taps, generator=g)
    state_pool = torch.randn(batch + 2, layers, hv, dk, dv, generator=g) * 0.1
    slots = torch.randperm(batch + 2, generator=g)[:batch].tolist()
    x, z = torch.randn(rows, channels, generator=g), torch.randn(rows, hv, dv, generator=g)
    a, b = torch.randn(rows, hv, generator=g), torch.randn(rows, hv, generator=g)
    a_log, dt_bias, norm_w = torch.randn(hv, generator=g), torch.randn(hv, generator=g), torch.randn(dv, generator=g)
    weight = torch.randn(channels, taps + 1, generator=g) * 0.5
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()
    got = kernel(x, a, b, z, a_log, dt_bias, norm_w, 1e-6, weight, conv_pool, state_pool, 1, slots, hk, dk, dv,
                 None, tokens)
    starts = [sum(tokens[:i]) for i in range(batch)]
    want = torch.empty_like(got)
    for i in range(max(tokens)):
        at = [j for j in range(batch) if tokens[j] > i]
        r = torch.tensor([starts[j] + i for j in at])
        want[r] = kernel(x[r], a[r], b[r], z[r], a_log, dt_bias, norm_w, 1e-6, weight, conv_ref, state_ref, 1,
                         [slots[j] for j in at], hk, dk, dv)
    assert (got - want).abs().max().item() < TOLERANCE * max(1.0, want.abs().max().item())
    assert torch.equal(conv_pool, conv_ref)
    assert (state_pool - state_ref).abs().max().item() < TOLERANCE
