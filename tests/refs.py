"""Independent references shared by the tests: the ml_dtypes and torch dtypes of each FP8 format, by name."""

import ml_dtypes
import torch

ALL_FORMATS = ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"]
ML_DTYPES = {
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
}
TORCH_DTYPES = {
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
}
