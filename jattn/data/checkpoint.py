"""Orbax glue: save the data iterator in the same checkpoint step as the train state.

The iterator of a `make_loader` dataset is a `grain.DatasetIterator`; its state
(`get_state()`, a small JSON-able dict: the source position, the packer's
position and the drop/truncate counts) is written by grain's orbax handler as
``<step>/<item>/process_<i>-of-<n>.json``, one file per JAX process. Use it as one
item of an `ocp.args.Composite`:

    import orbax.checkpoint as ocp
    from jattn.data import checkpoint as data_ckpt

    mngr = ocp.CheckpointManager(workdir / "checkpoints")
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state),
        data=data_ckpt.save_args(data_iterator),
    ))
    ...
    data_iterator = iter(make_loader(task, "train", ...))   # same arguments
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_train_state),
        data=data_ckpt.restore_args(data_iterator),
    ))
    # data_iterator (also restored["data"]) now yields the batches after `step`.

The state is taken when `save` is called (synchronously, also with asynchronous
checkpointing), so advancing the iterator afterwards does not change what is
saved. Restoring requires an iterator built with the same task, split and
arguments as the one saved.
"""

from __future__ import annotations

import grain

# The orbax CheckpointHandler of grain iterators (for `item_handlers=` if wanted).
IteratorHandler = grain.checkpoint.CheckpointHandler


def _check(iterator) -> None:
    if not isinstance(iterator, grain.DatasetIterator | grain.DataLoaderIterator):
        raise TypeError(
            "expected the iterator of a make_loader dataset (iter(make_loader(...))), got "
            f"{type(iterator).__name__}"
        )


def save_args(iterator: grain.DatasetIterator) -> grain.checkpoint.CheckpointSave:
    """Orbax args that save `iterator`'s state (an item of `ocp.args.Composite`)."""
    _check(iterator)
    return grain.checkpoint.CheckpointSave(iterator)


def restore_args(iterator: grain.DatasetIterator) -> grain.checkpoint.CheckpointRestore:
    """Orbax args that restore the saved state into `iterator` (and return it)."""
    _check(iterator)
    return grain.checkpoint.CheckpointRestore(iterator)
