"""The workers' readers-writer lock of mcore.testing.exclusive: readers share it, a writer waits for
the readers in a test and then runs alone, and a reader arriving while a writer waits queues behind it."""

import threading
import time

from mcore.testing.exclusive import WorkerLock


def test_a_writer_waits_for_the_readers_and_a_later_reader_waits_for_the_writer(tmp_path):
    reader, other_reader, writer, late_reader = (WorkerLock(tmp_path) for _ in range(4))
    order: list[str] = []

    reader.shared()
    other_reader.shared()  # readers share it
    assert (reader.held, other_reader.held) == ("shared", "shared")
    other_reader.release()

    def take(lock, how, name):
        getattr(lock, how)()
        order.append(name)

    writing = threading.Thread(target=take, args=(writer, "exclusive", "writer"))
    writing.start()
    time.sleep(0.3)
    late = threading.Thread(target=take, args=(late_reader, "shared", "late reader"))
    late.start()
    time.sleep(0.3)
    assert order == []  # the writer waits for the reader; the late reader queues behind the writer
    reader.release()
    writing.join(10)
    time.sleep(0.3)
    assert order == ["writer"]  # the writer runs alone
    writer.release()
    late.join(10)
    assert order == ["writer", "late reader"]
    for lock in (reader, other_reader, writer, late_reader):
        lock.close()
