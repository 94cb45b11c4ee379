"""Running an iterator one step ahead of its consumer, on a thread of its own.

Arrow's parsing, decompression, permutation and Parquet encoding release the GIL, so while the
consumer encodes one item the producer can already read the next: on two cores that overlaps the
two halves of each pass. One item ahead bounds the memory it costs.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, TypeVar

T = TypeVar("T")
_DONE = object()


def ahead(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """Yield what `items` yields, producing up to `depth` items ahead; an exception in the
    producer is raised in the consumer, and closing the consumer stops the producer."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        slots.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            slots.put((_DONE, None))
        except BaseException as exc:  # handed to the consumer, which raises it where it reads
            slots.put((_DONE, exc))

    thread = threading.Thread(target=produce, name="ahead", daemon=True)
    thread.start()
    try:
        while True:
            item, error = slots.get()
            if item is _DONE:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting for a slot, then let it finish
            try:
                slots.get(timeout=0.1)
            except queue.Empty:
                pass
        thread.join()
