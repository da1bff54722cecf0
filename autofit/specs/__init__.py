"""What is trained (ModelSpec and the family facts), on what (GPUSpec, ClusterSpec), on
which data (Workload), with which budget (Target), and how sizes and durations are written
(units).

The bottom of the pipeline: may import only ``autofit.errors`` and the standard library
(and PyYAML); imports without torch (``models.to_hf_config`` and ``derive.py``, which reads a model
type no family describes from the model transformers builds, import torch and transformers when
called). Everything else builds on these frozen dataclasses.
"""

from autofit.specs.cluster import ClusterSpec, parse_cluster
from autofit.specs.gpus import GPUS, GPUSpec, resolve_gpu
from autofit.specs.models import FAMILIES, MODELS, ModelSpec, resolve_model
from autofit.specs.target import Target
from autofit.specs.workload import LengthDistribution, Workload, load_lengths

__all__ = [
    "ClusterSpec",
    "FAMILIES",
    "GPUS",
    "GPUSpec",
    "LengthDistribution",
    "MODELS",
    "ModelSpec",
    "Target",
    "Workload",
    "load_lengths",
    "parse_cluster",
    "resolve_gpu",
    "resolve_model",
]
