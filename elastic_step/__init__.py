"""elastic-step: elastic, fault-tolerant training with an exactly-once data ledger."""

__version__ = "0.1.0"
