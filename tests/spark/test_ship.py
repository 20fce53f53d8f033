"""What evaluation and inference send the executors: a model that cannot travel is named."""

from __future__ import annotations

import threading
from typing import Any, cast

import pytest
from torch import nn

from paraloom.errors import NotPicklableError
from paraloom.spark.evaluation.inference import ship


class _Locked(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 2)
        self.lock = threading.Lock()


def test_a_model_holding_a_lock_is_refused_naming_what_to_keep_out() -> None:
    """evaluate() and predict() raised pickle's bare "cannot pickle '_thread.lock' object"
    where fit() said what to do."""
    with pytest.raises(NotPicklableError, match=r"cannot send the model to the Spark executors: "
                                                r"TypeError: cannot pickle '_thread.lock'.*Keep "
                                                r"open files, locks"):
        ship(cast(Any, None), _Locked(), cast(Any, None))  # refused before anything is sent
