"""An HA lighthouse's life: standby, elected, leading, deposed, standby again.

A lighthouse started with ``--state etcd://...`` binds its ports at once, but while it
does not lead:
- it answers every call that needs the leader with UNAVAILABLE ("standby lighthouse");
  clients with several lighthouse addresses then move on to the next one;
- its status and dashboard show it as a standby.

Once elected (:meth:`~rallypoint.lighthouse.etcd_state.EtcdSession.campaign`), it builds a
fresh core from the state in etcd and serves from it. When it stops leading (its etcd
session is lost, or a compare-and-swap of ``quorum_id`` fails), the core stops at once:
- waiting Quorum calls fail;
- liveness streams end, so the groups re-attach to the new leader.

The lighthouse then campaigns again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Callable

from rallypoint.lighthouse.core import LighthouseCore
from rallypoint.lighthouse.etcd_state import EtcdSession, EtcdStore
from rallypoint.lighthouse.state import StateStore

log = logging.getLogger("rallypoint.lighthouse")


class Leadership:
    """Runs the election and swaps the serving core (``install``) for each term."""

    def __init__(self, session: EtcdSession, address: str, make_job: Callable[[StateStore], Any],
                 install: Callable[[Any], None], retire: Callable[[], Awaitable[None]] | None = None) -> None:
        """``make_job(store)`` builds the default job (anything with a ``.core``) from the
        state etcd holds; ``install`` serves it; ``retire`` stops the term's other jobs
        (they were loaded from etcd during the term, and end with it)."""
        self.session = session
        self.address = address
        self._make_job = make_job
        self._install = install
        self._retire = retire
        self.core: LighthouseCore | None = None
        self.terms = 0
        self.elected = asyncio.Event()

    def leads(self) -> bool:
        return self.core is not None and self.session.leads()

    def role(self) -> str:
        return "leader" if self.leads() else "standby"

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign, lead, and after losing the lead campaign again, until ``stop``."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            campaign = asyncio.ensure_future(self.session.campaign(self.address))
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({campaign, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if stop.is_set():
                campaign.cancel()
                return
            try:
                await self._term(loop, stop)
            except Exception:  # noqa: BLE001 - a bug in one term must not leave the job without a leader
                log.exception("leading failed; resigning and standing by")
                self.core = None
                await self.session.resign()
                await asyncio.sleep(0.5)

    async def _term(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        """One term: load the state, serve from a fresh core until the lead is lost or ``stop``."""
        restored, events = await self.session.load()
        store = EtcdStore(self.session, restored, events, loop)
        job = self._make_job(store)
        core: LighthouseCore = job.core
        core.start()
        self.core = core
        self._install(job)
        self.terms += 1
        self.elected.set()
        log.warning("leading the job from %s (term %d): quorum_id %d, last quorum %s", self.session.spec,
                    self.terms, restored.quorum_id,
                    list(restored.last_quorum.replica_ids) if restored.last_quorum else "none")
        lost = asyncio.ensure_future(self.session.lost.wait())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            stopping.cancel()
            self.core = None
            await core.stop()  # waiting calls fail, streams end: the groups go to the new leader
            store.close()
            if self._retire is not None:
                await self._retire()
        if not stop.is_set():
            log.warning("stepped down; standing by")

    async def close(self) -> None:
        """Give the lead up now (a clean stop), so a standby takes over without waiting
        for the etcd lease to expire."""
        await self.session.resign()


__all__ = ["Leadership"]
