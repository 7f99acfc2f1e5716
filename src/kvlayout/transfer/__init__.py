from kvlayout.transfer.plan import (
    TransferError,
    TransferPlan,
    chunk_shape,
    load_blocks,
    prepare,
    store_blocks,
)

__all__ = ["TransferError", "TransferPlan", "chunk_shape", "load_blocks", "prepare", "store_blocks"]
