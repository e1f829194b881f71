"""What a run trains on: the text corpora and their deterministic batches (`corpus`), and local Hugging Face
tokenizers and datasets (`tokenized`). Imports only from `training.config` and `training.storage` within
training/."""
