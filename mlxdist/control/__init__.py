"""Pure-Python decision policies of the trainer (no MLX, no MPI).

Each stateful policy has ``state_dict``/``load_state_dict`` with JSON-safe
contents, so a checkpoint resumes its future decisions exactly.
"""

from .balancer import LoadBalancer
from .batch_size import BatchSizeController, BatchSizeError, Decision
from .early_stop import EarlyStopping
from .health import HealthMonitor, HealthVerdict, ReduceOnPlateau
from .schedule import LRSchedule, lr_at
from .split import (
    AccumulationController,
    AccumulationError,
    accumulation_steps,
    micro_batches,
    proportional_split,
)
from .step_plan import Decision as PlanDecision
from .step_plan import StepPlan, replan

__all__ = [
    "AccumulationController",
    "AccumulationError",
    "BatchSizeController",
    "BatchSizeError",
    "Decision",
    "EarlyStopping",
    "HealthMonitor",
    "HealthVerdict",
    "LRSchedule",
    "LoadBalancer",
    "PlanDecision",
    "StepPlan",
    "ReduceOnPlateau",
    "accumulation_steps",
    "lr_at",
    "micro_batches",
    "proportional_split",
    "replan",
]
