"""The interface every framework adapter implements, so that the worker's training loop and
collective layer are written once. Gradients cross the collective as one flat float32 numpy
buffer: the sum of per-sample gradients of this rank's minibatch (the engine divides by the
global sample count after the allreduce, so uneven batches weigh correctly)."""

from __future__ import annotations

import abc

import numpy as np


class StateSnapshot:
    """A trainer's state at one step, held in host memory apart from the live state, and
    serialised when to_bytes() is called (a checkpoint's sender thread, off the step's path)."""

    def __init__(self, data: bytes):
        self._data = data

    def to_bytes(self) -> bytes:
        """As state_bytes() returned at the step the snapshot was taken."""
        return self._data


class Trainer(abc.ABC):
    """One rank's model and optimizer."""

    framework: str

    @property
    @abc.abstractmethod
    def num_gradient_values(self) -> int:
        """Length of the flat gradient buffer."""

    @property
    def gradient_device(self):
        """The torch device whose memory this trainer computes gradients into and applies them
        from without a copy (a step buffer there crosses no bus), or None: host memory (numpy)
        only, which every trainer takes."""
        return None

    @property
    def passes_computed_again(self) -> int:
        """Forward and backward passes this trainer computed again since it was made (float16's
        overflows: frameworks/loss_scale.py); 0 where no pass is ever computed again."""
        return 0

    @abc.abstractmethod
    def compute_gradients(self, features: np.ndarray, labels: np.ndarray, out) -> float:
        """Write the sum of per-sample gradients into `out` (a numpy array, or a float32 tensor on
        gradient_device); return the summed loss."""

    @abc.abstractmethod
    def apply_gradients(self, summed, total_samples: int) -> None:
        """Apply the allreduced gradient sum divided by the global sample count (`summed`: as
        compute_gradients' `out`; it may be divided in place)."""

    @abc.abstractmethod
    def scale_learning_rate(self, factor: float) -> None:
        """Set the optimizer's learning rate to the model definition's times `factor` (from the
        model definition's, never compounding; a state loaded meanwhile does not change it).
        ModelDefinitionError when the rate is not a constant one can scale."""

    def warm_up(self, features: np.ndarray, labels: np.ndarray) -> None:
        """Do once, before the worker joins a round, the slow first-step work (tracing) for
        batches shaped like these, changing no state; so that a joiner's first step does not
        stall every rank. Eager frameworks have nothing to do."""

    @abc.abstractmethod
    def state_bytes(self) -> bytes:
        """Model parameters and optimizer state, serialised (for broadcast and checkpoints)."""

    def state_snapshot(self) -> StateSnapshot:
        """The state at this step for a checkpoint, to be serialised off the step's path; a
        trainer whose state serialises cheaply hands over state_bytes() itself."""
        return StateSnapshot(self.state_bytes())

    @abc.abstractmethod
    def load_state_bytes(self, data: bytes) -> None:
        """Replace model parameters and optimizer state with a serialised copy."""

    @abc.abstractmethod
    def model_bytes(self) -> bytes:
        """Model parameters only (the final model)."""

    @abc.abstractmethod
    def load_model_bytes(self, data: bytes) -> None:
        """Replace model parameters with a serialised copy from model_bytes()."""

    @abc.abstractmethod
    def model_bytes_of_state(self, data: bytes) -> bytes:
        """The parameters part of a state_bytes() blob (warm start from a checkpoint)."""

    @abc.abstractmethod
    def model_bytes_of_logged_model(self, model_uri: str) -> bytes:
        """The parameters of a logged or registered model (warm start from `models:/NAME@ALIAS`),
        as model_bytes(): the weights file its training run logged (frameworks/weights.py), parsed
        without pickle and checked against this network. Never the MLflow flavour's loader."""

    @abc.abstractmethod
    def predict(self, features: np.ndarray) -> np.ndarray:
        """Model outputs as numpy, without gradients."""

    @abc.abstractmethod
    def loss_value(self, outputs: np.ndarray, labels: np.ndarray) -> float:
        """The model definition's (mean) loss on numpy outputs."""

    # -- MLflow (call with an active run) ------------------------------------------------------
    @abc.abstractmethod
    def log_mlflow_model(self, input_example: np.ndarray, signature):
        """The final model in the framework's MLflow flavour, named "model" (explicit
        pip_requirements, so logging takes well under a second). Returns the ModelInfo."""

    @abc.abstractmethod
    def log_serving_model(self, input_example: np.ndarray, signature):
        """The model in its serving format (TorchScript, SavedModel), named "serving-model", so
        that mlflow.pyfunc loads it and predicts the outputs. Returns the ModelInfo."""
