import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def tiny(name: str, layers: int = 2, **overrides):
    """A small variant of a registered architecture that trains on the CPU in well under a second."""
    from autofit.specs import MODELS

    base = MODELS[name]
    fields = dict(
        num_layers=layers,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2 if base.num_kv_heads < base.num_heads else 8,
        head_dim=64 if base.model_type == "gemma2" else 32,
        intermediate_size=704,
        vocab_size=1000,
        name=f"tiny-{name}",
    )
    fields.update(overrides)
    return base.variant(**fields)


@pytest.fixture
def tiny_model():
    return tiny
