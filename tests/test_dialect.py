"""OCP <-> FNUZ dialect conversion (fp8train.numerics.quant.convert_dialect).

FNUZ (AMD MI300) formats have the same bit layout as the OCP ones with the exponent bias one higher, no negative
zero and NaN at 0x80. So the same byte means half as much in FNUZ, and a correct conversion re-encodes (and
adjusts the scale) so that every dequantized value is kept. Values are checked with ml_dtypes and torch's casts,
never with fp8train's own dequantize.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8train.numerics.formats import FORMATS
from fp8train.numerics.quant import Fp8Tensor, convert_dialect, quantize

pytestmark = pytest.mark.usefixtures("single_thread")

from refs import ML_DTYPES, TORCH_DTYPES  # noqa: E402
PAIRS = [("e4m3fn", "e4m3fnuz"), ("e5m2", "e5m2fnuz")]
CODES = np.arange(256, dtype=np.uint8)


def ml_values(codes: np.ndarray, name: str) -> np.ndarray:
    return np.asarray(codes, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float32)


def ref_dequantize(q: Fp8Tensor) -> np.ndarray:
    """ml_dtypes-decoded bytes times the scale (tensor / row scales broadcast; block scales repeated, cropped)."""
    values = ml_values(q.data.view(torch.uint8).numpy(), q.fmt.name)
    scale = q.scale.numpy()
    if q.granularity == "block":
        br, bc = q.block
        rows, cols = (1, values.shape[0]) if values.ndim == 1 else values.shape[-2:]
        scale = np.repeat(np.repeat(scale, br, axis=-2), bc, axis=-1)[..., :rows, :cols].reshape(values.shape)
    return values * scale


def finite_codes(name: str) -> np.ndarray:
    return CODES[np.isfinite(ml_values(CODES, name))]


def every_code_tensor(name: str, rng, scale=1.0) -> Fp8Tensor:
    """An Fp8Tensor holding every finite code of ``name`` (zeros, subnormals, +-max), shuffled, 1-D."""
    codes = rng.permutation(finite_codes(name))
    data = torch.from_numpy(codes).view(TORCH_DTYPES[name])
    return Fp8Tensor(data, torch.tensor(scale, dtype=torch.float32), FORMATS[name])


def random_tensor(rng) -> torch.Tensor:
    """Wide-range values with zeros, tiny values that land on subnormals, and some at the very top."""
    x = rng.choice([-1.0, 1.0], (64, 200)) * rng.uniform(1, 2, (64, 200)) * np.exp2(rng.integers(-24, 8, (64, 200)))
    x[rng.random(x.shape) < 0.05] = 0.0
    x[0, :5] = x.max() * 4  # the amax of rows / blocks containing it
    return torch.from_numpy(x.astype(np.float32))


def assert_same_values(converted: Fp8Tensor, original: Fp8Tensor):
    a, b = ref_dequantize(converted), ref_dequantize(original)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    finite = ~np.isnan(b)
    np.testing.assert_array_equal(a[finite], b[finite])


@pytest.mark.parametrize("ocp,fnuz", PAIRS)
def test_round_trip_of_every_code_preserves_values(ocp, fnuz, rng):
    for scale in (1.0, 0.375, 2.0**-20):
        q = every_code_tensor(ocp, rng, scale)
        to_fnuz = convert_dialect(q, fnuz)
        assert to_fnuz.fmt.name == fnuz and to_fnuz.data.dtype == TORCH_DTYPES[fnuz]
        assert to_fnuz.scale.dtype == torch.float32
        assert_same_values(to_fnuz, q)
        back = convert_dialect(to_fnuz, ocp)
        assert back.fmt.name == ocp and back.data.dtype == TORCH_DTYPES[ocp]
        assert_same_values(back, q)


@pytest.mark.parametrize("granularity,block", [("tensor", (1, 128)), ("row", (1, 128)), ("block", (1, 128)),
                                               ("block", (16, 48))])
@pytest.mark.parametrize("ocp,fnuz", PAIRS)
def test_round_trip_of_quantized_tensors_preserves_values(ocp, fnuz, granularity, block, rng):
    q = quantize(random_tensor(rng), ocp, granularity=granularity, block=block)
    # The data really exercises the edges: max codes, subnormals and zeros are all present.
    values = ml_values(q.data.view(torch.uint8).numpy(), ocp)
    fmt = FORMATS[ocp]
    assert (np.abs(values) == fmt.max).any()
    assert ((values != 0) & (np.abs(values) < fmt.min_normal)).any()
    assert (values == 0).any()
    to_fnuz = convert_dialect(q, fnuz)
    assert_same_values(to_fnuz, q)
    assert to_fnuz.scale.shape == q.scale.shape
    back = convert_dialect(to_fnuz, ocp)
    assert_same_values(back, q)


@pytest.mark.parametrize("ocp,fnuz", PAIRS)
def test_nan_survives_conversion(ocp, fnuz):
    x = torch.tensor([1.0, float("nan"), -3.0, 0.0])
    q = quantize(x, ocp, scale=1.0)
    to_fnuz = convert_dialect(q, fnuz)
    assert to_fnuz.data.view(torch.uint8)[1].item() == 0x80  # the single FNUZ NaN
    assert_same_values(to_fnuz, q)
    assert_same_values(convert_dialect(to_fnuz, ocp), q)


@pytest.mark.parametrize("fnuz,ocp,top", [("e4m3fnuz", "e4m3fn", 240.0), ("e5m2fnuz", "e5m2", 57344.0)])
def test_fnuz_to_ocp_with_top_value_keeps_what_is_representable(fnuz, ocp, top, rng):
    """An FNUZ tensor holding every finite code: its max (240 / 57344) forbids doubling into OCP (480 > 448,
    114688 > 57344), and its smallest subnormal (2^-10 / 2^-17) is half of OCP's, so no power-of-two scale change
    keeps everything. Documented rule: the first factor (1, 1/2, 2) that clips nothing is used, here 1, and the
    values that must round do so to nearest even. Everything representable in the OCP format is kept exactly."""
    q = every_code_tensor(fnuz, rng, scale=0.5)
    converted = convert_dialect(q, ocp)
    assert converted.scale.item() == q.scale.item()
    original = ml_values(q.data.view(torch.uint8).numpy(), fnuz)
    got = ml_values(converted.data.view(torch.uint8).numpy(), ocp)
    assert top in original
    representable = original.astype(ML_DTYPES[ocp]).astype(np.float32) == original
    assert np.array_equal(got[representable], original[representable])
    assert top in got
    # The rest (FNUZ-only subnormals) round to nearest even, like ml_dtypes' cast.
    rounded = original[~representable].astype(ML_DTYPES[ocp]).astype(np.float32)
    assert np.array_equal(got[~representable], rounded)
    assert np.abs(original[~representable]).max() < FORMATS[ocp].min_normal


@pytest.mark.parametrize("fnuz,ocp", [("e4m3fnuz", "e4m3fn"), ("e5m2fnuz", "e5m2")])
def test_fnuz_to_ocp_without_top_binade_is_exact(fnuz, ocp, rng):
    """Without FNUZ's top values there is room to double: all codes up to half the OCP max convert exactly
    (with the scale halved), subnormals included."""
    half_max = FORMATS[ocp].max / 2
    codes = finite_codes(fnuz)
    codes = codes[np.abs(ml_values(codes, fnuz)) <= half_max]
    data = torch.from_numpy(rng.permutation(codes)).view(TORCH_DTYPES[fnuz])
    q = Fp8Tensor(data, torch.tensor(3.0), FORMATS[fnuz])
    converted = convert_dialect(q, ocp)
    assert_same_values(converted, q)
    assert converted.scale.item() == 1.5


@pytest.mark.parametrize("ocp,fnuz", PAIRS)
def test_reading_ocp_bytes_as_fnuz_is_off_by_exactly_2x(ocp, fnuz):
    """Reinterpreting bytes without conversion is the classic dialect bug: every finite nonzero value halves.
    Checked for all 256 codes with torch's casts and with ml_dtypes, excluding the codes that are NaN or inf in
    either dialect and 0x80 (-0 in OCP, NaN in FNUZ)."""
    codes = torch.arange(256, dtype=torch.uint8)
    as_ocp = codes.view(TORCH_DTYPES[ocp]).float()
    as_fnuz = codes.view(TORCH_DTYPES[fnuz]).float()
    usable = torch.isfinite(as_ocp) & torch.isfinite(as_fnuz) & (codes != 0x80)
    # Left out: 0x80 and the specials, 2 NaN codes in e4m3fn, 2 inf + 6 NaN in e5m2 (0x80 is FNUZ's only NaN).
    assert int(usable.sum()) == {"e4m3fn": 256 - 3, "e5m2": 256 - 9}[ocp]
    assert torch.equal(as_fnuz[usable] * 2, as_ocp[usable])
    ml_ocp, ml_fnuz = ml_values(CODES, ocp), ml_values(CODES, fnuz)
    keep = usable.numpy()
    np.testing.assert_array_equal(ml_fnuz[keep] * 2, ml_ocp[keep])


@pytest.mark.parametrize("ocp,fnuz", PAIRS)
def test_reinterpreted_quantized_tensor_is_off_by_2x_but_converted_is_exact(ocp, fnuz, rng):
    x = random_tensor(rng)
    x[0, :5] = 0.0  # no value at the very top, which is NaN/inf in the other dialect for some codes
    q = quantize(x, ocp)
    reinterpreted = Fp8Tensor(q.data.view(torch.uint8).view(TORCH_DTYPES[fnuz]), q.scale, FORMATS[fnuz])
    wrong, right = ref_dequantize(reinterpreted), ref_dequantize(q)
    nonzero = right != 0
    np.testing.assert_array_equal(wrong[nonzero] * 2, right[nonzero])
    assert_same_values(convert_dialect(q, fnuz), q)


def test_formats_of_very_different_range_take_a_power_of_two_past_2x():
    """e5m2 values up to 57344 into e4m3fn (max 448): neither 1, 1/2 nor 2 fits, so the scale grows by the
    smallest power of two that does, 2^ceil(log2(57344 / 448)) = 128; these values stay exact (ml_dtypes)."""
    values = np.array([57344.0, -1024.0, 3.0, 0.25, 0.0, -0.5], dtype=np.float32)  # 0.25 / 128: min subnormal
    q = quantize(torch.from_numpy(values), "e5m2", scale=1.0)
    moved = convert_dialect(q, "e4m3fn")
    assert moved.fmt.name == "e4m3fn" and moved.scale.item() == 128.0
    expected = (values / np.float32(128.0)).astype(ML_DTYPES["e4m3fn"])
    np.testing.assert_array_equal(moved.data.view(torch.uint8).numpy(), expected.view(np.uint8))
    np.testing.assert_array_equal(moved.dequantize().numpy(), values)


def test_conversion_keeps_granularity_block_axis_and_amax():
    """Per-column scales (row granularity, axis 0) stay per column: the result keeps the granularity, block, axis
    and the amax the scale was made from (hand-computed: max |x| per column), and OCP -> FNUZ doubles the scale."""
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    q = quantize(x, "e4m3fn", granularity="row", axis=0)
    converted = convert_dialect(q, "e4m3fnuz")
    assert (converted.granularity, converted.block, converted.axis) == ("row", (1, 128), 0)
    assert converted.amax.tolist() == [[2.0, 3.0]]
    assert converted.fmt is FORMATS["e4m3fnuz"]
    assert torch.equal(converted.scale, q.scale * 2)
