"""Serving a state dict without copying it first: live tensors, frozen just before they change.

Why: a healing peer reads the whole state of its source. Copying that state before
serving it (what ``HTTPTransport`` did) cost the sender 1.1-1.6 s per GB on its quorum
thread, and as much memory again, before the first byte left. Forward and backward do
not change parameters or optimizer state, so those can be served from the caller's own
memory while the step computes; only the optimizer update changes them.

The rules (:class:`LiveEncoded`):

* **Copied at once** (by :func:`~rallypoint.transports.wire.encode`): tensors under
  ``copy_below`` bytes (BatchNorm's running statistics and step counters, which forward
  changes; they are small), device and non-contiguous tensors (they need a host copy
  anyway), and inference tensors (no version counter to guard them).
* **Served live**: every other tensor, read straight from the caller's memory.
* **Copied ahead of the freeze** (``precopy=True``; off by default): once a receiver
  asks, a background thread copies the undelivered live tensors back to front while
  forward and backward run (they change nothing served live), so the freeze finds little
  or nothing left to copy when a heal outlasts the step. It is not the training thread
  nor the quorum thread, and serving never waits for it: the first bytes leave from live
  memory at once. Off by default because in the Manager's usual step the sources reach
  the freeze only after the healing peer has everything (its allreduce waits for its
  heal), so the background copy would be memory (up to the state's size) and memory
  bandwidth spent on bytes that are delivered anyway. It pays where the sender steps
  while a peer still reads and has idle cores: a DiLoCo sender's inner steps during the
  sync delay on a GPU box.
* **Frozen before the update**: :meth:`LiveEncoded.freeze` copies every live tensor that
  has not yet been delivered to every expected receiver, and retires the delivered ones
  (back to front, so the delivery of the head goes on while the tail is copied)
  (a later read of a retired tensor is refused: the receiver heals again). Once its
  copying is measured, it waits for the receivers instead when they should have the
  rest sooner than copying on would take (:func:`wait_for_delivery`; bounded by that
  copy time, so a stalled receiver costs at most about one copy more). It returns
  once no piece of live memory is being checksummed whole, so the caller may then change
  its state: a piece already summed and still being sent fails the receiver's check if it
  changes, and is fetched again from the copy. A piece larger than the send size is
  summed part by part as its parts are sent (:meth:`Encoded._iter_inline`); the freeze
  does not wait for it, and a stream that finds the state frozen after the last part
  ends there instead of sending the sum (``Overtaken``), since the caller may have changed
  the memory between two parts: the receiver fetches the rest of that range again (from
  its first piece not yet verified), from the copy. Delivery is counted piece by piece,
  each piece at most once per expected receiver (a piece sent again, to a receiver that
  retries, does not stand in for one never sent). With several receivers, one that gets a
  piece twice (its connection dropped with the piece on its way) still counts for one
  that has not had it: that one finds the tensor retired after the sender's step (HTTP
  410) and heals again. The transport freezes in
  ``disallow_checkpoint`` (the Manager's ``should_commit``, right before the optimizer
  may step, for a state served from the quorum thread; a live state no receiver has asked
  for yet is withdrawn instead, never copied; a state already frozen is left as it is)
  and ``freeze_checkpoint`` (a state served on the training thread, whose receiver may
  not have asked yet: always kept); an optimizer step pre-hook freezes for any optimizer step
  taken while something is served live (a DiLoCo sender's inner steps during the sync
  delay; a step taken without the Manager). The frozen copies are served until every
  receiver has its bytes (or says it is done: a striped receiver takes only part from
  each source; a state with no data bytes: until each said so), then
  dropped; at the latest after the transport's timeout, or when a newer state replaces it.
* **Cost in the usual step**: none. A healing replica's allreduce waits for its heal, so
  its sources reach ``should_commit`` only after it has everything and said so.
* **Caught if it happens anyway**: each live tensor's autograd version counter (which
  every in-place change bumps) is recorded when served and checked before and after
  each piece is read; a change spoils the offer, and every later request is refused
  with a message that names the tensor (for a piece summed part by part, also before its
  sum is sent, so a change between two parts never gets a sum that agrees). Each piece's
  (or part's) checksum is computed just before it is sent, so a change during the send
  fails the receiver's check.

Residual risk, by design: an in-place change of a large tensor outside an optimizer step
(not BatchNorm: its buffers are small and copied) that is still running when its last
piece is checked can reach a receiver undetected. ``HTTPTransport(serve="copy")`` serves
a full copy taken at ``send_checkpoint`` for code that does that.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from rallypoint.transports import _tensors as T
from rallypoint.transports._encode import Encoded, Overtaken

logger = logging.getLogger("rallypoint.transports.http")

#: The freeze copies into slabs of up to this many bytes (fewer, larger allocations).
SLAB_BYTES = 64 << 20
#: Tensors smaller than this are copied when served (whatever changes during forward,
#: like BatchNorm's running statistics, is small); larger ones are served live.
COPY_BELOW = 1 << 20
#: The freeze measures its copying for at least this long (and one tensor) before it
#: weighs waiting for the receivers instead (:func:`wait_for_delivery`).
MEASURE_S = 0.005


def wait_for_delivery(left_send: float, rate_before: float, left_copy: float, copy_rate: float,
                      rate_copying: float) -> float:
    """How long the freeze should wait for the receivers instead of copying on (0: copy).

    ``left_send``: bytes the receivers still have to get; they arrived at ``rate_before``
    bytes/s before the freeze began and at ``rate_copying`` while it copied. ``left_copy``:
    bytes the freeze still has to copy, at ``copy_rate`` (measured). Copying back to front
    while the receivers read front to back meets in the middle after about
    ``left_copy / (copy_rate + rate_copying)`` seconds; waiting takes about
    ``left_send / rate_before``. Wait when that is sooner: at most twice as long as the
    receivers are expected to take and never longer than copying on would (a receiver
    that stalls then costs at most that much more).

    Why: where the transfer's cores are not spare (the serving threads and a receiver on
    the same host, or a slow copy into fresh memory), the copy slowed the transfer it
    raced: at a 0.3 s step with a GPU-like wait, the freeze took 301 ms where torchft,
    which waits for the transfer, took 150 ms. Where cores are spare, the copy costs the
    transfer nothing and meeting in the middle stays the faster way.
    """
    if left_copy <= 0 or left_send <= 0 or rate_before <= 0 or copy_rate <= 0:
        return 0.0
    send_s = left_send / rate_before
    meet_s = left_copy / (copy_rate + max(0.0, rate_copying))
    return min(2 * send_s, meet_s) if send_s < meet_s else 0.0


class StateChanged(RuntimeError):
    """A live tensor changed while it was served, or was retired after delivery."""

    #: what the checkpoint server answers when a range cannot start for this reason
    http_status = 410


class LiveEncoded(Encoded):
    """An :class:`Encoded` whose uncopied tensors are the caller's live memory (see the
    module docstring). ``receivers``: how many peers are expected to read it all;
    ``on_complete`` runs once every piece was delivered that often and :meth:`freeze`
    has returned (it frees the state: never under a freeze still at work; a delivery
    that completes during the freeze is completed by the freeze's end)."""

    def __init__(self, enc: Encoded, receivers: int, on_complete: Callable[[], None] | None = None,
                 precopy: bool = False) -> None:
        self.__dict__.update(enc.__dict__)
        n = len(self.views)
        self._cv = threading.Condition()
        self._live = [not c for c in self.copied]
        self._versions = [int(s._version) if live else -1 for s, live in zip(self.sources, self._live)]
        npieces = [0] * n
        for _, _, ti, _ in self.pieces:
            npieces[ti] += 1
        self._need = [k * max(1, receivers) for k in npieces]
        self._sent = [0] * n
        # Sends per piece, each counted up to the number of receivers: a piece sent twice
        # (a retried range, a receiver's piece lost with its dropped connection) does not
        # stand in for another piece of its tensor that was never sent.
        self._piece_sent = [0] * len(self.pieces)
        # Delivery so far, for the freeze's choice between copying and waiting: bytes per
        # piece of each tensor (its pieces are equal but for the last), bytes sent, the
        # bytes every receiver needs in all, and when the first read began.
        self._piece_bytes = [v.nbytes / k if k else 0.0 for v, k in zip(self.views, npieces)]
        self._sent_bytes = 0.0
        self._need_bytes = float(sum(v.nbytes for v in self.views) * max(1, receivers))
        self._first_read: float | None = None
        self._owed = sum(1 for k in self._need if k)  # tensors not yet delivered to everyone
        self._no_data = self._owed == 0  # no piece to send: delivered once each receiver said done
        self._summing = [0] * n  # pieces of live memory being checksummed (or copied), per tensor
        self._retired = [False] * n
        self._on_complete = on_complete
        self._slab: torch.Tensor | None = None  # where the freeze carves its copies from
        self._slab_used = 0
        self._slab_want = 0
        self._slab_lock = threading.Lock()  # the copier and a freeze that gave up waiting for it
        self._thawed = False  # the freeze returned: the caller may change its state now
        self._receivers = max(1, receivers)
        self._done = 0  # receivers that said they have everything they need from us
        self._precopy = precopy
        self._precopier: threading.Thread | None = None
        #: bytes the background copier copied ahead of the freeze
        self.precopied = 0
        #: a receiver asked for something (a header or a range) since it was served
        self.started = False
        self.frozen = False
        self.spoiled: str | None = None
        self.live_bytes = sum(v.nbytes for v, live in zip(self.views, self._live) if live)
        if self.live_bytes:
            _watch(self)

    # ------------------------------------------------------------ reading (connection threads)

    def _key(self, ti: int) -> str:
        return f"tensor {self.keys[ti]}"

    def _changed(self, ti: int) -> bool:
        return int(self.sources[ti]._version) != self._versions[ti]

    def _spoil(self, ti: int) -> StateChanged:
        if self.spoiled is None:
            self.spoiled = (f"the sender's {self._key(ti)} changed while it was served (an in-place change outside "
                            "an optimizer step); nothing torn is delivered: heal again, or serve copies "
                            "(HTTPTransport(serve='copy'))")
            logger.warning("%s", self.spoiled)
        return StateChanged(self.spoiled)

    def _take(self, ti: int) -> tuple[memoryview, bool]:
        self.started = True
        with self._cv:
            if self._first_read is None:
                self._first_read = time.monotonic()
            if self._precopy and self._precopier is None and not self.frozen and self.live_bytes:
                self._precopier = threading.Thread(target=self._precopy_all, name="checkpoint-precopy",
                                                   daemon=True)
                self._precopier.start()
            if self.spoiled is not None:
                raise StateChanged(self.spoiled)
            if not self.views:
                raise StateChanged("the checkpoint was withdrawn")
            if not self._live[ti]:
                return self.views[ti], False
            if self._retired[ti]:
                raise StateChanged(f"{self._key(ti)} was delivered and the sender has stepped since; "
                                   "it is not served again (heal again)")
            if self._changed(ti):
                raise self._spoil(ti)
            self._summing[ti] += 1
            return self.views[ti], True

    def _unfrozen(self) -> bool:
        return not self.frozen

    def _parts_sent(self, ti: int) -> None:
        with self._cv:
            if self.frozen:
                # Once the freeze returns the caller may change the memory: what was sent
                # may mix two states. The stream ends; the range is fetched again, from the copy.
                raise Overtaken(f"{self._key(ti)}: the served state was frozen while a piece of it was sent")
            if self._changed(ti):  # outside an optimizer step: as _give_back does, but before the sum leaves
                raise self._spoil(ti)

    def _summed(self, ti: int, live: bool) -> None:
        if live:
            with self._cv:
                self._summing[ti] -= 1
                self._cv.notify_all()

    def _give_back(self, pi: int, ti: int, live: bool, sent: bool) -> None:
        if not live and not sent:  # a copied piece that did not leave (or is counted when its batch has)
            return
        complete = False
        with self._cv:
            if live and not self.frozen and self._changed(ti):
                # Changed outside an optimizer step while this piece was read: the
                # checksum may or may not catch it (it was computed before the send).
                self._spoil(ti)
                sent = False
            if live and self._thawed:
                # Read from live memory and still on its way when the freeze returned: the
                # caller may have changed it since, and the receiver's check then fails and
                # it fetches the range again, from the copy. Counted, the piece could end
                # the serving (delivered) before that retry; it is the copy's send that counts.
                sent = False
            if sent and self._piece_sent[pi] < self._receivers:
                self._piece_sent[pi] += 1
                self._sent[ti] += 1
                self._sent_bytes += self._piece_bytes[ti]
                if self._sent[ti] == self._need[ti]:
                    self._owed -= 1
                    complete = self.delivered and self._thawed
                    if self._owed == 0:
                        self._cv.notify_all()  # a freeze may be waiting for the delivery
        if complete:
            self._completed()

    def _completed(self) -> None:
        cb, self._on_complete = self._on_complete, None
        if cb is not None:
            cb()

    @property
    def delivered(self) -> bool:
        """Every expected receiver has it: each said it is done, or every piece was sent
        to each of them. A state with no data bytes (no tensors, or only empty ones) has
        no piece to send: it is delivered only when each receiver said done (or it
        expires). Why: counted by its pieces, it was delivered before anyone asked, so it
        was withdrawn at the sender's freeze right after its vote, every round: HTTP 410
        to a joiner slower to ask than the sender's step (the livelock that kept
        training-thread heals opt-in)."""
        if self._done >= self._receivers:
            return True
        return self._owed == 0 and not self._no_data

    def delivered_tensor(self, ti: int) -> bool:
        """Tensor ``ti`` was sent to every expected receiver."""
        return self._sent[ti] >= self._need[ti]

    def receiver_done(self) -> None:
        """A receiver has all it needs from us (a striped heal takes only part of it)."""
        with self._cv:
            self._done += 1
            complete = self._done == self._receivers and self._thawed
            self._cv.notify_all()
        if complete:
            self._completed()

    def release(self) -> None:
        """Drop every tensor (the frozen copies' memory goes at once, not at the next
        garbage collection); only once no stream reads them: the views do not keep
        their memory alive."""
        with self._cv:
            self._tensors = []
            self.views = []
            self._live = [False] * len(self._live)
            self._retired = [True] * len(self._retired)
            self._on_complete = None

    # ------------------------------------------------------------ freezing (the caller's thread)

    def _copy(self, ti: int) -> Any:
        """A private copy of live tensor ``ti``'s bytes, carved from a slab (see
        :data:`SLAB_BYTES`); None when the state was released meanwhile (withdrawn by
        another thread, or delivered after a freeze that stopped waiting for the
        background copier): nothing is left to copy.

        Why slabs: the freeze runs on the training thread, and copying into fresh memory
        is mostly page faults on a 4 KiB-page heap (one per page; ``clone`` of 3 MiB
        tensors mmaps each anew). A slab advised for transparent huge pages faults once
        per 2 MiB. The copy is a flat ``uint8`` tensor: only its bytes are served."""
        with self._cv:
            if not self.views:
                return None
            src = self._tensors[ti]
        n = src.numel() * src.element_size()
        with self._slab_lock:
            if self._slab is None or self._slab_used + n > self._slab.numel():
                size = max(n, min(SLAB_BYTES, self._slab_want))
                self._slab = torch.empty(size, dtype=torch.uint8)
                T.advise_huge_pages(self._slab)
                self._slab_used = 0
            dst = self._slab[self._slab_used : self._slab_used + n]
            self._slab_used += (n + 63) & ~63  # each copy cache-line aligned
            self._slab_want -= n
        flat = src.detach().reshape(-1)
        try:
            dst.copy_(flat.view(torch.uint8))  # releases the GIL: serving threads go on
        except RuntimeError:  # dtypes torch will not reinterpret as bytes
            T.byte_view(dst)[:] = T.byte_view(src)
        return dst

    def _swap_in(self, i: int, clone: torch.Tensor) -> None:
        """Serve tensor ``i`` from ``clone`` from now on (under the lock). A change of the
        live tensor during the copy spoils the offer (the copy may be torn)."""
        if self._changed(i):
            self._spoil(i)
        self._tensors[i] = clone
        self.views[i] = T.byte_view(clone)
        self._live[i] = False

    def _precopy_all(self) -> None:
        """The background copier (see the module docstring): undelivered live tensors,
        back to front, each swapped in once copied; it stops at the freeze, which waits
        for the tensor in hand (the copies are only valid until the caller's next
        change, and the freeze is what allows that change)."""
        with self._cv, self._slab_lock:
            order = [i for i in reversed(range(len(self._live))) if self._live[i]]
            self._slab_want = sum(self.views[i].nbytes for i in order if self._sent[i] < self._need[i])
        for i in order:
            with self._cv:
                if self.frozen or self.spoiled is not None or not self.views or self._done >= self._receivers:
                    return
                if not self._live[i] or self._sent[i] >= self._need[i]:
                    continue  # already delivered to everyone: retired by the freeze, never copied
            clone = self._copy(i)  # serving goes on from the live memory meanwhile
            if clone is None:
                return
            with self._cv:
                if not self.views or self._thawed:
                    return  # the freeze gave up waiting for this copy: the caller may have changed it
                self._swap_in(i, clone)
                self.precopied += clone.numel() * clone.element_size()

    def _delivered(self, i: int, keep: bool) -> bool:
        """Under the lock: tensor ``i`` needs no copy (every receiver has it, or is done,
        or the state is withdrawn)."""
        return self._sent[i] >= self._need[i] or self._done >= self._receivers or not keep

    def _wait_instead(self, left_copy: float, copy_rate: float, rate_before: float, began: float, sent0: float,
                      wait_s: float) -> bool:
        """Under the lock, during a freeze that began at ``began`` with ``sent0`` bytes
        delivered: wait for the receivers if :func:`wait_for_delivery` says so (at most
        ``wait_s``); whether it waited."""
        now = time.monotonic()
        rate_copying = (self._sent_bytes - sent0) / (now - began) if now > began else 0.0
        pause = min(wait_s, wait_for_delivery(max(0.0, self._need_bytes - self._sent_bytes), rate_before,
                                              left_copy, copy_rate, rate_copying))
        if pause <= 0:
            return False
        self._cv.wait_for(lambda: self.delivered or self.spoiled is not None, timeout=pause)
        logger.debug("freeze: waited %.3f s (at most %.3f s) for the receivers: %s", time.monotonic() - now, pause,
                     "all delivered" if self.delivered else "copying the rest")
        return True

    def freeze(self, wait_s: float, keep: bool = True) -> int:
        """Make the served state independent of the caller's memory; returns the bytes
        copied. Undelivered live tensors are copied (reads go on from the copies),
        delivered ones are retired. It returns once no piece of live memory is being
        checksummed (a checksum takes well under a millisecond; ``wait_s`` bounds it):
        a piece whose checksum was taken before the caller changes it can still be on
        its way, but then its bytes fail the receiver's check (it fetches that range
        again, from the copy); it never arrives torn, and it does not count towards
        delivery (the copy's send does, or the receiver's ``/done``). ``keep=False`` (the state is
        withdrawn, never served again): retire everything, copy nothing."""
        with self._cv:
            if self.frozen:
                return 0
            self.frozen = True
            copier = self._precopier
        _unwatch(self)
        if copier is not None:  # it stops after the tensor in hand; its copies are served
            copier.join(wait_s)
            if copier.is_alive():
                logger.warning("the background copy of the served state still runs after %.1f s", wait_s)
        with self._cv:
            todo = [i for i, live in enumerate(self._live) if live]
        copied = 0
        with self._cv, self._slab_lock:  # at most this much is copied: what is not delivered yet
            undelivered = {i for i in todo if self._sent[i] < self._need[i]}
            self._slab_want = sum(self.views[i].nbytes for i in undelivered)
            left_copy = float(self._slab_want)
            began, sent0 = time.monotonic(), self._sent_bytes
            reading_s = began - self._first_read if self._first_read is not None else 0.0
            rate_before = sent0 / reading_s if reading_s > 0 else 0.0
        # Back to front: the receivers read ranges front to back, so while this thread
        # copies the tail, the serving threads go on delivering the head from the live
        # memory; a tensor delivered by the time it is reached is retired, not copied.
        # The freeze ends where the two meet: it copies only what no receiver has yet,
        # and takes no longer than copying all of it (or than waiting for all of it).
        # Once, it may instead wait for the receivers to finish, when that is expected
        # to be sooner than its own copying (wait_for_delivery).
        copy_s, waited = 0.0, False
        for i in reversed(todo):
            with self._cv:
                if not self.views:
                    # Withdrawn and released meanwhile by another thread (a shutdown, say):
                    # nothing is read from the caller's memory any more; nothing to copy.
                    break
                size = self.views[i].nbytes
                delivered = self._delivered(i, keep)
                if not delivered and not waited and copy_s > 0 and copy_s >= MEASURE_S and self.spoiled is None:
                    waited = self._wait_instead(left_copy, copied / copy_s, rate_before, began, sent0, wait_s)
                    delivered = self._delivered(i, keep)
                if delivered or self.spoiled is not None:
                    self._retired[i] = True
            if not delivered and self.spoiled is None:
                t0 = time.perf_counter()
                clone = self._copy(i)  # reads go on from the live memory meanwhile
                if clone is None:
                    break
                copy_s += time.perf_counter() - t0
                with self._cv:
                    if self.views:  # not released while copying
                        self._swap_in(i, clone)
                copied += clone.numel() * clone.element_size()
            if i in undelivered:
                left_copy -= size
        with self._cv:  # reads of live memory still being summed, copied ones included
            if not self._cv.wait_for(lambda: not any(self._summing), timeout=wait_s):
                busy = [self._key(i) for i, k in enumerate(self._summing) if k]
                logger.warning("%s: a checksum of live memory still running after %.1f s", ", ".join(busy), wait_s)
        with self._cv:
            self._thawed = True
        with self._slab_lock:
            self._slab = None  # the copies keep their slabs alive, and free them with the last of them
        if copied or self.precopied:
            logger.info("froze the served state: copied %d bytes not yet delivered (%d more copied ahead of it)",
                        copied, self.precopied)
        with self._cv:
            complete = self.delivered
        if complete:
            self._completed()
        return copied


# --------------------------------------------------------------------------- optimizer hook

_WATCHED: weakref.WeakSet[LiveEncoded] = weakref.WeakSet()
_HOOK_LOCK = threading.Lock()
_hook: Any = None
#: The longest an optimizer step waits for one in-flight read of live memory.
HOOK_WAIT_S = 10.0


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Any optimizer step while something is served live freezes it first."""
    for enc in list(_WATCHED):
        enc.freeze(HOOK_WAIT_S)


def _watch(enc: LiveEncoded) -> None:
    global _hook
    with _HOOK_LOCK:
        if _hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook  # not at import: cold start

            _hook = register_optimizer_step_pre_hook(_before_optimizer_step)
        _WATCHED.add(enc)


def _unwatch(enc: LiveEncoded) -> None:
    with _HOOK_LOCK:
        _WATCHED.discard(enc)


__all__ = ["COPY_BELOW", "MEASURE_S", "LiveEncoded", "StateChanged", "wait_for_delivery"]
