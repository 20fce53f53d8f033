"""Threshold / bitmap encoding: exact conservation, reference semantics, format switching."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paraloom.sync.encoding import (
    Format,
    bitmap_encode,
    choose_format,
    decode,
    decode_into,
    empty_message,
    encode,
    encode_scan,
    full_step_mask,
    gap16_encode,
    keep_largest,
    message_steps,
    moved_index,
    quantize_threshold,
    scan,
    threshold_encode,
    top_count,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
PRECISION = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}
SPECIAL = [0.0, 1.0, -1.0, 0.5, -0.5, 0.4999, 0.75, -0.75, 2.0, -3.0, float("inf"),
           float("-inf"), float("nan")]


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, float]:
    """A tensor of any shape and float dtype, and a tau; values are multiples of tau mostly."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(1, 9), min_size=0, max_size=3))
    numel = math.prod(shape)
    tau = math.ldexp(draw(st.floats(0.5, 1.0)), draw(st.integers(-18, 3)))
    mantissa, exponent = quantize_threshold(tau, dtype)
    tau_eff, lowbit = math.ldexp(mantissa, exponent), math.ldexp(1.0, exponent)
    near = st.floats(-40, 40) | st.sampled_from(SPECIAL)
    # Around the exactness bound 2**(exponent + p), where encoding must stop.
    bound = st.sampled_from([2.0 ** PRECISION[dtype] * lowbit / tau_eff * f
                             for f in (0.99, 1.0, 1.01, -1.0, 3.0)])
    anything = st.floats(width=32, allow_nan=True, allow_infinity=True)
    scaled = draw(st.lists(near | bound, min_size=numel, max_size=numel))
    raw = draw(st.lists(anything, min_size=numel, max_size=numel))
    use_raw = draw(st.lists(st.booleans(), min_size=numel, max_size=numel))
    values = [r if pick else s * tau_eff for s, r, pick in zip(scaled, raw, use_raw, strict=True)]
    return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape), tau


def _messages(v: torch.Tensor, tau: float) -> list:
    return [threshold_encode(v, tau), bitmap_encode(v, tau, 1), bitmap_encode(v, tau, -1),
            encode(v, tau, previous=Format.THRESHOLD), encode(v, tau, previous=Format.BITMAP),
            gap16_encode(v, tau)]


def _exact(t: torch.Tensor) -> list[Fraction | float]:
    return [Fraction(x) if math.isfinite(x) else x for x in t.double().reshape(-1).tolist()]


def _reference(v: torch.Tensor, msg) -> torch.Tensor:
    """What a message must decode to, computed independently in float64."""
    x = v.double().reshape(-1)
    tau = msg.tau
    full = (x.abs() >= tau) & (x.abs() < math.ldexp(1.0, msg.exponent + PRECISION[v.dtype]))
    out = torch.where(full, torch.sign(x) * tau, torch.zeros_like(x))
    if msg.format == Format.BITMAP:
        half = (x * msg.half_sign >= tau / 2) & (x * msg.half_sign < tau)
        out = torch.where(half, torch.full_like(x, msg.half_sign * tau / 2), out)
    return out


@settings(max_examples=150, deadline=None)
@given(cases())
def test_decoded_plus_new_residual_is_exactly_the_old_residual(case) -> None:
    v, tau = case
    for msg in _messages(v, tau):
        residual = v.clone()
        decode(msg, residual, sign=-1)
        decoded = decode(msg, torch.zeros_like(v))
        for before, d, after in zip(_exact(v), _exact(decoded), _exact(residual), strict=True):
            if isinstance(before, Fraction):
                assert d + after == before, (msg.format, before, d, after)
            else:  # NaN / inf are never encoded and stay in the residual untouched
                assert d == 0 and (after == before or (math.isnan(after) and math.isnan(before)))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_messages_decode_to_the_reference_steps(case) -> None:
    v, tau = case
    mantissa, exponent = quantize_threshold(tau, v.dtype)
    assert mantissa % 2 == 1 and mantissa < 256
    bits = min(8, max(1, PRECISION[v.dtype] - 8))  # 8 for float32/64, 3 float16, 1 bfloat16
    assert abs(math.ldexp(mantissa, exponent) / tau - 1) <= 2.0 ** -bits
    for msg in _messages(v, tau):
        assert (msg.mantissa, msg.exponent) == (mantissa, exponent) and msg.numel == v.numel()
        decoded = decode(msg, torch.zeros(v.numel(), dtype=torch.float64))
        assert torch.equal(decoded, _reference(v, msg))
        assert msg.moved == int(full_step_mask(v, mantissa, exponent).sum())
        assert msg.payload.dtype == torch.int32
        if msg.format == Format.THRESHOLD:
            assert msg.payload.numel() == msg.moved
            index = msg.payload.abs().long()
            assert torch.all(index[1:] > index[:-1])  # ascending, unique: deterministic
        elif msg.format == Format.GAP16:
            assert msg.payload.numel() == -(-msg.moved // 2)  # no escapes below 32767 elements
            assert torch.equal(moved_index(msg), moved_index(threshold_encode(v, tau)))
        else:
            assert msg.payload.numel() == -(-v.numel() // 16)


@settings(max_examples=150, deadline=None)
@given(cases(), st.integers(0, 40))
def test_keep_largest_keeps_the_count_largest_exactly(case, count) -> None:
    v, tau = case
    found = scan(v, tau)
    kept = keep_largest(found, count)
    flat = v.reshape(-1).double()
    assert kept.indices.numel() <= min(count, found.indices.numel())
    assert torch.all(kept.indices[1:] > kept.indices[:-1])  # ascending
    assert set(kept.indices.tolist()) <= set(found.indices.tolist())
    if kept.indices.numel():
        magnitudes = flat[kept.indices].abs()
        assert kept.tau >= found.tau and float(magnitudes.min()) >= kept.tau
        bits = min(8, max(1, PRECISION[v.dtype] - 8))  # tau's grid: rounded down by < 2**-(bits-1)
        assert kept.tau > float(magnitudes.min()) * (1 - 2.0 ** (1 - bits)) \
            or kept.tau == found.tau
        left = set(found.indices.tolist()) - set(kept.indices.tolist())
        if kept.indices.numel() == count:  # nothing left out is larger than what was kept
            assert all(abs(float(flat[i])) <= float(magnitudes.min()) for i in left)
    for format in (Format.THRESHOLD, Format.GAP16):
        msg = encode_scan(v, kept, format=format)
        assert msg.moved == kept.indices.numel() and msg.tau == kept.tau
        index, positive = message_steps(kept)
        assert torch.equal(moved_index(msg), index)
        residual = v.clone()
        decode(msg, residual, sign=-1, steps=(index, positive))
        parsed = v.clone()
        decode(msg, parsed, sign=-1)
        assert torch.equal(residual, parsed) or torch.equal(residual.isnan(), parsed.isnan())
        decoded = decode(msg, torch.zeros_like(v))
        for before, d, after in zip(_exact(v), _exact(decoded), _exact(residual), strict=True):
            if isinstance(before, Fraction):
                assert d + after == before  # exact with the raised tau too


@settings(max_examples=150, deadline=None)
@given(cases(), st.integers(1, 40))
def test_top_count_keeps_what_a_scan_and_keep_largest_keep(case, count) -> None:
    v, _ = case
    count = min(count, v.numel())
    flat = v.reshape(-1)
    top = top_count(v, count)
    magnitudes = flat.abs()
    ranked = magnitudes.topk(count).values.double()
    if not (float(ranked.min()) > 0 and math.isfinite(float(ranked.max()))):
        assert top is None  # a zero, NaN or infinity among the largest: the caller scans
        return
    if top is None:  # tau out of range, or an element past the exact bound: left to the scan
        return
    assert top.indices.numel() == count and torch.all(top.indices[1:] > top.indices[:-1])
    assert torch.equal(top.values, flat[top.indices])
    assert float(top.peaks.double().max()) == float(magnitudes.double().max())
    # The same as the general path: a scan at a tau that finds at least `count`, then the
    # largest `count` of what it found (the same set, and the same tau, up to ties).
    on_grid = math.ldexp(*quantize_threshold(float(ranked.min()), v.dtype, round_down=True))
    found = keep_largest(scan(v, on_grid), count)
    assert (top.mantissa, top.exponent) == (found.mantissa, found.exponent)
    assert sorted(flat[top.indices].abs().tolist()) == sorted(flat[found.indices].abs().tolist())


def test_top_count_refuses_a_count_it_cannot_keep() -> None:
    for count in (0, 5, -1, True):
        with pytest.raises(ValueError, match="count="):
            top_count(torch.ones(4), count)


def test_quantize_threshold_rounds_down_when_asked() -> None:
    for value in (0.3, 1.0, 1e-6, 123.456, 2.0 ** -20 * 255.9):
        mantissa, exponent = quantize_threshold(value, round_down=True)
        down = math.ldexp(mantissa, exponent)
        assert down <= value < down * (1 + 2.0 ** -7) and mantissa % 2 == 1


@settings(max_examples=100, deadline=None)
@given(cases())
def test_automatic_format_follows_the_hysteresis_rule(case) -> None:
    v, tau = case
    for previous in Format:
        msg = encode(v, tau, previous=previous)
        assert msg.format == choose_format(msg.moved, v.numel(), previous)


def test_choose_format_switches_at_n_over_16_up_and_n_over_32_down() -> None:
    n = 1600  # 100 bitmap words
    assert choose_format(99, n, Format.THRESHOLD) == Format.THRESHOLD
    assert choose_format(100, n, Format.THRESHOLD) == Format.BITMAP
    assert choose_format(50, n, Format.BITMAP) == Format.BITMAP
    assert choose_format(49, n, Format.BITMAP) == Format.THRESHOLD


def test_choose_format_weighs_gap16_messages_at_half_a_word_per_step() -> None:
    n = 1600  # 100 bitmap words; a gap16 message of k steps takes ceil(k / 2) words
    assert choose_format(198, n, Format.GAP16, Format.GAP16) == Format.GAP16
    assert choose_format(199, n, Format.GAP16, Format.GAP16) == Format.BITMAP
    assert choose_format(100, n, Format.BITMAP, Format.GAP16) == Format.BITMAP
    assert choose_format(98, n, Format.BITMAP, Format.GAP16) == Format.GAP16
    v = torch.zeros(n)
    v[:150] = 1.0  # 150 steps: 75 words as gap16, 150 as threshold words
    assert encode(v, 1.0).format == Format.BITMAP
    assert encode_scan(v, scan(v, 1.0), sparse=Format.GAP16).format == Format.GAP16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_switching_formats_over_a_stream_loses_nothing(dtype: torch.dtype, seed: int) -> None:
    """Quiet, loud, quiet: the format switches both ways and every step's mass is accounted for."""
    g = torch.Generator().manual_seed(seed)
    n, tau = 512, 2.0 ** -10
    residual = torch.zeros(n, dtype=dtype)
    total_update = [Fraction(0)] * n
    total_sent = [Fraction(0)] * n
    fmt, formats = Format.THRESHOLD, []
    for step in range(60):
        loud = 20 <= step < 40
        # Dyadic updates (k * 2**-16): every float sum below is exact, so totals must match.
        update = torch.randint(-200 if loud else -8, 201 if loud else 9, (n,), generator=g)
        update = update.to(dtype) * 2.0 ** -16
        residual += update
        msg = encode(residual, tau, previous=fmt, half_sign=1 if step % 2 else -1)
        before = _exact(residual)
        decode(msg, residual, sign=-1)
        sent = _exact(decode(msg, torch.zeros(n, dtype=torch.float64)))
        assert [s + r for s, r in zip(sent, _exact(residual), strict=True)] == before
        total_update = [t + u for t, u in zip(total_update, _exact(update), strict=True)]
        total_sent = [t + s for t, s in zip(total_sent, sent, strict=True)]
        fmt = msg.format
        formats.append(fmt)
    assert Format.BITMAP in formats[20:40] and formats[-1] == Format.THRESHOLD
    assert formats[0] == Format.THRESHOLD
    final = _exact(residual)
    assert [s + r for s, r in zip(total_sent, final, strict=True)] == total_update


def test_bitmap_half_step_is_symmetric() -> None:
    tau = 2.0 ** -4
    v = torch.tensor([0.75 * tau, -0.75 * tau, 0.25 * tau, 1.5 * tau, -1.5 * tau])
    plus = decode(bitmap_encode(v, tau, half_sign=1), torch.zeros(5))
    minus = decode(bitmap_encode(v, tau, half_sign=-1), torch.zeros(5))
    assert plus.tolist() == [tau / 2, 0, 0, tau, -tau]
    assert minus.tolist() == [0, -tau / 2, 0, tau, -tau]


def test_threshold_message_is_never_capped_or_suppressed() -> None:
    tau = 2.0 ** -8
    dense = torch.full((1000,), 3 * tau)
    msg = threshold_encode(dense, tau)  # DL4J would cap this at N/16 = 62 entries
    assert msg.moved == 1000 and msg.payload.numel() == 1000
    single = torch.zeros(100)
    single[37] = -tau
    msg = threshold_encode(single, tau)  # DL4J drops messages of a single element
    assert msg.payload.tolist() == [-38]
    assert decode(msg, torch.zeros(100))[37] == -tau


def test_quantize_threshold_keeps_8_bits_in_float32_and_fewer_in_16_bit_dtypes() -> None:
    assert quantize_threshold(1e-3) == (131, -17)  # 131 / 2**17 = 0.000999451
    assert quantize_threshold(2.0 ** -7) == (1, -7)
    assert quantize_threshold(0.75, torch.float64) == (3, -2)
    assert quantize_threshold(1e-3, torch.float16) == (1, -10)  # 3 bits: 0.125 steps
    assert quantize_threshold(1.2e-3, torch.float16) == (5, -12)
    assert quantize_threshold(1e-3, torch.bfloat16) == (1, -10)  # a power of two


@pytest.mark.parametrize("tau", [0, -1e-3, float("nan"), float("inf"), True, "1e-3"])
def test_quantize_threshold_rejects_bad_taus(tau) -> None:
    with pytest.raises(ValueError, match="tau="):
        quantize_threshold(tau)


def test_quantize_threshold_checks_the_dtype_range() -> None:
    with pytest.raises(ValueError, match="float16"):
        quantize_threshold(1e-9, torch.float16)
    with pytest.raises(ValueError, match="float16"):
        quantize_threshold(1e6, torch.float16)
    with pytest.raises(TypeError, match="floating point"):
        quantize_threshold(1e-3, torch.int32)


def test_decode_validates_its_output_and_sign() -> None:
    msg = threshold_encode(torch.ones(8), 0.5)
    with pytest.raises(ValueError, match="8 elements"):
        decode(msg, torch.zeros(9))
    with pytest.raises(ValueError, match="contiguous"):
        decode(msg, torch.zeros(8, 2)[:, 0])
    with pytest.raises(ValueError, match="sign="):
        decode(msg, torch.zeros(8), sign=2)
    with pytest.raises(TypeError, match="floating point"):
        threshold_encode(torch.ones(4, dtype=torch.int64), 0.5)


def test_empty_message_moves_nothing() -> None:
    out = torch.arange(5.0)
    assert decode(empty_message(5), out).tolist() == [0, 1, 2, 3, 4]


def test_decode_into_a_wider_dtype_and_on_views() -> None:
    v = torch.tensor([[1.0, -2.0], [0.1, 0.6]], dtype=torch.float16)
    msg = encode(v, 0.5)
    assert decode(msg, torch.zeros(2, 2, dtype=torch.float64)).tolist() == [[0.5, -0.5],
                                                                             [0.0, 0.5]]


@pytest.mark.parametrize("fmt", [Format.THRESHOLD, Format.BITMAP, Format.GAP16])
def test_moved_index_names_exactly_the_elements_a_message_changes(fmt: Format) -> None:
    v = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    msg = {Format.THRESHOLD: threshold_encode(v, 1.0), Format.BITMAP: bitmap_encode(v, 1.0, -1),
           Format.GAP16: gap16_encode(v, 1.0)}[fmt]
    changed = torch.nonzero(decode(msg, torch.zeros(1000)) != 0).reshape(-1)
    index = moved_index(msg)
    assert index.dtype == torch.int64 and index.tolist() == changed.tolist()
    assert moved_index(empty_message(1000)).numel() == 0


def test_gap16_carries_gaps_beyond_int16_with_escapes() -> None:
    v = torch.zeros(200_000)
    where = [0, 1, 32_766, 32_767, 32_768, 100_000, 199_999]
    v[where] = torch.tensor([1.0, -1.0, 2.0, -1.5, 1.0, -3.0, 1.0])
    msg = gap16_encode(v, 1.0)
    assert msg.format == Format.GAP16 and msg.moved == len(where)
    assert moved_index(msg).tolist() == where
    assert torch.equal(decode(msg, torch.zeros(200_000)), decode(threshold_encode(v, 1.0),
                                                                 torch.zeros(200_000)))
    assert msg.payload.numel() < len(where)  # two entries a word, escapes included


@pytest.mark.parametrize("fmt", [Format.THRESHOLD, Format.BITMAP, Format.GAP16])
def test_decode_into_tensors_end_to_end_equals_decode_into_one(fmt: Format) -> None:
    g = torch.Generator().manual_seed(4)
    v = torch.randn(2 * 3 * 4 + 5 + 7, generator=g)
    msg = {Format.THRESHOLD: threshold_encode(v, 1.0), Format.BITMAP: bitmap_encode(v, 1.0, 1),
           Format.GAP16: gap16_encode(v, 1.0)}[fmt]
    base = torch.randn(v.numel(), generator=g)
    outs = [base[:24].clone().view(2, 3, 4).permute(2, 0, 1),  # non-contiguous
            base[24:29].clone(), base[29:].clone().view(7, 1)]
    bounds = torch.tensor([o.numel() for o in outs]).cumsum(0)
    before = torch.cat([o.reshape(-1) for o in outs])  # row-major, whatever the layout
    decode_into(msg, outs, bounds)
    after = torch.cat([o.reshape(-1) for o in outs])
    assert torch.equal(after, decode(msg, before))


@settings(max_examples=100, deadline=None)
@given(cases(), st.integers(1, 7))
def test_scan_finds_the_full_steps_and_each_chunks_peak(case, chunk: int) -> None:
    v, tau = case
    found = scan(v, tau, chunk=chunk)
    mask = full_step_mask(v, found.mantissa, found.exponent).reshape(-1)
    assert found.indices.tolist() == torch.nonzero(mask).reshape(-1).tolist()
    flat = v.reshape(-1).double().abs()
    expected = [flat[i: i + chunk].max().item() for i in range(0, flat.numel(), chunk)]
    got = found.peaks.double().tolist()
    assert len(got) == len(expected)
    assert all(g == e or (math.isnan(g) and math.isnan(e)) for g, e in zip(got, expected,
                                                                            strict=True))


def test_scan_across_chunk_boundaries_matches_the_whole_tensor_mask() -> None:
    g = torch.Generator().manual_seed(0)
    v = torch.randn(10_007, generator=g)
    v[[0, 4_095, 4_096, 10_006]] = torch.tensor([float("inf"), float("nan"), 3e9, -5.0])
    for chunk in (1, 4_096, 4_097, 10_007, 1 << 20):
        found = scan(v, 1.5, chunk=chunk)
        mask = full_step_mask(v, found.mantissa, found.exponent)
        assert torch.equal(found.indices, torch.nonzero(mask).reshape(-1))
        assert 10_006 in found.indices.tolist() and 0 not in found.indices.tolist()
        assert found.peaks.numel() == -(-10_007 // chunk)
    with pytest.raises(ValueError, match="chunk=0"):
        scan(v, 1.5, chunk=0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3000), st.sampled_from([1e-3, 0.02, 0.6]),
       st.sampled_from([None, 64, 100, 1 << 19]), st.booleans())
def test_a_sparse_scan_by_rows_finds_what_the_mask_of_every_element_finds(
        seed: int, numel: int, density: float, chunk: int | None, specials: bool) -> None:
    # The scan compares rows of 32 first where few rows reach tau: rows with a NaN, an
    # infinity, a tail shorter than a row, and dense residuals (every element compared) too.
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(numel, generator=g)
    v[torch.rand(numel, generator=g) < density] *= 100
    if specials:
        where = torch.randint(0, numel, (3,), generator=g)
        v[where] = torch.tensor([float("nan"), float("inf"), -300.0])
        v[where[0] ^ 1 if where[0] ^ 1 < numel else where[0]] = 300.0  # a NaN's row-mate
    found = scan(v, 50.0, chunk=chunk)
    mask = full_step_mask(v, found.mantissa, found.exponent)
    assert torch.equal(found.indices, torch.nonzero(mask).reshape(-1))
    size = chunk or numel
    expected = [v[i: i + size].abs().max().item() for i in range(0, numel, size)]
    assert all(g == e or (math.isnan(g) and math.isnan(e))
               for g, e in zip(found.peaks.tolist(), expected, strict=True))
