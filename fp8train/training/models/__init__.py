"""What a run trains: fp8train's built-in decoder and `build_model` (`decoder`), Hugging Face causal LMs from a
local folder (`hf`), FP8 models saved and loaded as Hugging Face folders (`pretrained`), and the transformers
Trainer callback (`hf_trainer`). Imports only from the sub-folders before it (config, storage, data, parallel)
within training/."""
