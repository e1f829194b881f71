"""Layer 5, the serving side of the same numerics: FP8 KV-cache evaluation and FP8 weight export with OCP/FNUZ
dialect conversion. Imports only from the layers below."""
