"""What runs on every Ray Train worker: a `Trainer` of components, each owning its state, its
schedule and its part of the checkpoint (docs/design.md §11): the data cursor, the checkpointer,
the metrics logger, the validator, and optional callbacks (fault injection, row recording, group log)."""
