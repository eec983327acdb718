"""Executors: where the worker (ModelRunner) runs. `local` = in the engine process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from scheduler.types import StepRequest, StepResult
from workers.config import ModelConfig
from workers.runner import ModelRunner


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its model and state storage (plain data)."""

    model_dir: str
    dtype: str  # "float32" | "bfloat16"
    device: str
    num_pages: int
    page_size: int
    num_slots: int


def build_runner(spec: WorkerSpec) -> ModelRunner:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    return ModelRunner.create(ModelConfig.from_dir(spec.model_dir), Path(spec.model_dir), dtype, spec.device,
                              spec.num_pages, spec.page_size, spec.num_slots)


class LocalExecutor:
    def __init__(self, spec: WorkerSpec):
        self.runner = build_runner(spec)

    def execute(self, requests: list[StepRequest]) -> StepResult:
        return self.runner.execute(requests)

    def release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)

    def shutdown(self) -> None:
        pass
