"""Whether the packages ``train.trackers`` names are installed: looked up, never imported, so
the login node's checks (the workflow's start, ``python -m pipeline.config check``, render) stay
free of torch and of the trackers' own imports. The trackers themselves are
:mod:`pipeline.observe.trackers`."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from pipeline.errors import PipelineError

#: What ``train.trackers`` may name, the module each imports and the distribution that has it.
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
DISTRIBUTIONS = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}
KEY = "train.trackers"


def installed(name: str) -> bool:
    """Whether tracker ``name``'s package can be found. An import hook that refuses it, or a
    module set to None in ``sys.modules``, counts as missing."""
    try:
        return importlib.util.find_spec(PACKAGES[name]) is not None
    except (ImportError, ValueError):
        return False


def missing(name: str, key: str = KEY) -> PipelineError:
    """The error for tracker ``name``'s package missing: the key, and how to install it."""
    return PipelineError(
        f"{key} names {name}, but the {PACKAGES[name]} package is not installed: "
        f"pip install 'zerosnake[trackers]' (in a checkout: pip install -e '.[trackers]'; or "
        f"pip install {DISTRIBUTIONS[name]}), or remove {name} from {key}")


def check_packages(names: Iterable[str], key: str = KEY) -> None:
    """A :class:`PipelineError` (:func:`missing`) for the first tracker of ``names`` whose
    package is not installed: a user's setting, refused before anything is queued."""
    for name in names:
        if name in PACKAGES and not installed(name):
            raise missing(name, key)
