"""Fair shares between tenants (`--tenants`): what each has been served, and who is next (pure).

In the spirit of the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024), each tenant has a counter of the work it was served, divided by its weight:

- **Encoder seconds**: each encoder sub-request is charged as it is sent, to every request whose
  media it carries: its items' cost at that encoder's speed, and its share of the sub-request's
  fixed cost (lanes.Lanes.encoder_s).
- **Tokens**: when a consumer's answer carries `usage`, its computed prompt tokens (cached ones
  left out) and its output tokens.

A tenant is active while one of its requests is in flight. One that becomes active again starts
from at least just under the smallest counter of the active tenants, so time spent idle is not
banked as a claim on the fleet. The encoder queue serves, within a priority class, the waiting
group of the tenant with the smallest encoder counter first (`Ledger.rank`); nothing waits for a
share, so a tenant alone gets the whole fleet. A tenant is over its share (`Ledger.share`) when
its counter leads the smallest active one by more than SLACK_S encoder-seconds or SLACK_TOKENS tokens, or when
it asks more of the encoders than its weighted share of them serves (`Ledger.asked`): the
encoder-seconds its requests bring as they arrive, turned away or not, over the last
DEMAND_WINDOW_S. Fair queueing keeps a flooding tenant's counter level with the others', so the
counters alone would call it within its share; what it asks for is what is not. When the fleet is
past a deadline, such a tenant's requests are the ones turned away with 429. While tenants
compete (requests in flight, or within the last CONTENTION_LINGER_S), an encoder sub-request
carries at most CONTENDED_GROUP_ITEMS items and an encoder runs CONTENDED_INFLIGHT of them at once,
so the next group due waits for one short sub-request to end, not for a flood's whole request.

One ledger per process: with `--workers`, each worker keeps its own, and weighs what a tenant
asks of it against its own part of the encoders (the kernel spreads requests evenly).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

# How far a tenant's weighted encoder-seconds may lead the least-served active tenant's before it
# is over its share: about a second or two of one encoder's backlog, so a short burst is not punished.
SLACK_S = 2.0
# The same for weighted tokens (computed prompt plus output): a few long answers.
SLACK_TOKENS = 16384
WITHIN, OVER = "within", "over"
# What a tenant asked of the encoders is a sum that decays with this time constant: its rate over
# about the last ten seconds, long enough that one large request is not a flood.
DEMAND_WINDOW_S = 10.0
# How far above its weighted share of the encoders a tenant may ask before it is over its share.
DEMAND_SLACK = 0.25
# While two or more tenants have requests in flight, an encoder sub-request carries at most this
# many items (Lanes.group_cap): a less-served tenant's group that arrives waits for the encoder's
# short sub-requests to end, not for a flood's whole request. A group of a few images is still
# one vision batch on the encoder, and each more sub-request costs it one fixed cost.
CONTENDED_GROUP_ITEMS = 2
# For the quantum, a tenant still competes this long after its last request ended: a chat client
# pauses between questions, and a quantum that lapsed in each pause let the flood's next
# sub-requests carry 8 images each, which the chat's next image then waited behind (on real
# engines, 128 of 235 shared sub-requests beside two chat clients).
CONTENTION_LINGER_S = 5.0
# While tenants compete, an encoder runs this many of our sub-requests at once (lanes.BUSY_INFLIGHT
# otherwise): vLLM runs what it holds as one vision batch, and a less-served tenant's image that
# joined two quanta waited for all of them (real engines, two runs of three interleaved rounds:
# its encode p50 beside a flood 35-40% shorter, the flood's goodput 0-5% lower: one answer's
# round trip idles the encoder).
CONTENDED_INFLIGHT = 1


def in_class(priority: int) -> bool:
    """Whether a request of this (clamped) `priority` is of a class the tenants file granted: below
    the default 0, so vLLM's priority scheduling runs it first too."""
    return priority < 0


def _lifted(counter: float, floor: float) -> float:
    """The counter of a tenant back from idle: at least one float step under the active floor.
    Under it rather than at it, because a tie goes by arrival: at the floor, a chat's image
    waited behind every group the flood at the floor had queued before it, though the two had
    been served alike. One step banks nothing."""
    return max(counter, math.nextafter(floor, -math.inf))


def pay_riders(owed: dict[str, float], cost: float) -> list[tuple[str, float]]:
    """What each tenant of another request waiting for a group's encodes pays as the group, of
    `cost` image-equivalents, is sent: what it still owes, up to the cost, taken off `owed`; one
    paid up is let go, so it lifts that request's later groups no more."""
    paid = []
    for tenant, due in list(owed.items()):
        part = min(due, cost)
        paid.append((tenant, part))
        if due > part:
            owed[tenant] = due - part
        else:
            del owed[tenant]
    return paid


# Told of each charge: tenant, encoder seconds, computed prompt tokens, output tokens.
OnCharge = Callable[[str, float, int, int], None]
# Which of one encoder's queued groups (in queue order) a given request goes ahead of, from that
# encoder's seconds per sub-request and per image-equivalent (Ledger.behind).
Behind = Callable[[Iterable[Any], float, float], list[Any]]


class Account:
    """One tenant's books: raw totals (for metrics) and weighted counters (for the order)."""

    __slots__ = (
        "weight",
        "active",
        "encoder_v",
        "tokens_v",
        "encoder_s",
        "prompt_tokens",
        "output_tokens",
        "asked_s",
        "asked_at",
        "ended_at",
    )

    def __init__(self, weight: float) -> None:
        self.weight = weight
        # Its requests in flight.
        self.active = 0
        self.encoder_v = 0.0
        self.tokens_v = 0.0
        self.encoder_s = 0.0
        self.prompt_tokens = 0
        self.output_tokens = 0
        # Encoder-seconds asked for, decayed to `asked_at` (DEMAND_WINDOW_S).
        self.asked_s = 0.0
        self.asked_at = 0.0
        # When its last request in flight ended (CONTENTION_LINGER_S).
        self.ended_at = -math.inf

    def asking(self, now: float) -> float:
        """Encoder-seconds per second it asks for, as of `now`."""
        if now > self.asked_at:
            self.asked_s *= math.exp((self.asked_at - now) / DEMAND_WINDOW_S)
            self.asked_at = now
        return self.asked_s / DEMAND_WINDOW_S


class Ledger:
    def __init__(self, on_charge: OnCharge | None = None) -> None:
        self._accounts: dict[str, Account] = {}
        self.on_charge = on_charge

    def _account(self, tenant: str, weight: float | None = None) -> Account:
        account = self._accounts.get(tenant)
        if account is None:
            account = self._accounts[tenant] = Account(weight or 1.0)
        elif weight is not None:
            account.weight = weight  # the tenants file was read again
        return account

    def _floor(self) -> tuple[float, float] | None:
        """The smallest counters among the active tenants; None when none is active."""
        active = [a for a in self._accounts.values() if a.active]
        if not active:
            return None
        return min(a.encoder_v for a in active), min(a.tokens_v for a in active)

    def began(self, tenant: str, weight: float) -> None:
        """A request of `tenant` is in flight: an idle tenant is lifted to just under the active floor."""
        account = self._account(tenant, weight)
        if not account.active:
            floor = self._floor()
            if floor is not None:
                account.encoder_v = _lifted(account.encoder_v, floor[0])
                account.tokens_v = _lifted(account.tokens_v, floor[1])
        account.active += 1

    def ended(self, tenant: str, now: float) -> None:
        account = self._accounts.get(tenant)
        if account is not None and account.active:
            account.active -= 1
            if not account.active:
                account.ended_at = now

    def contended(self) -> bool:
        """Whether more than one tenant has requests in flight."""
        return sum(1 for account in self._accounts.values() if account.active) > 1

    def competing(self, now: float) -> bool:
        """Whether more than one tenant has requests in flight or had within CONTENTION_LINGER_S:
        when the quantum applies."""
        since = now - CONTENTION_LINGER_S
        return sum(1 for account in self._accounts.values() if account.active or account.ended_at > since) > 1

    def charge_encoder(self, tenant: str, seconds: float) -> None:
        account = self._account(tenant)
        account.encoder_s += seconds
        account.encoder_v += seconds / account.weight
        if self.on_charge is not None:
            self.on_charge(tenant, seconds, 0, 0)

    def charge_tokens(self, tenant: str, prompt: int, output: int) -> None:
        account = self._account(tenant)
        account.prompt_tokens += prompt
        account.output_tokens += output
        account.tokens_v += (prompt + output) / account.weight
        if self.on_charge is not None:
            self.on_charge(tenant, 0.0, prompt, output)

    def rank(self, tenant: str | None) -> float:
        """Where `tenant`'s waiting groups stand in the encoder queue: its weighted encoder-seconds
        (lower goes first)."""
        account = self._accounts.get(tenant) if tenant is not None else None
        return account.encoder_v if account is not None else 0.0

    def token_rank(self, tenant: str | None) -> float:
        """Where `tenant`'s requests stand in a consumer's window (windows.py): its weighted tokens."""
        account = self._accounts.get(tenant) if tenant is not None else None
        return account.tokens_v if account is not None else 0.0

    def behind(self, tenant: str, priority: int = 0) -> Behind:
        """Which of one encoder's queued groups a new request of `tenant` at `priority` goes ahead
        of, in the order the queue serves them (sharing.take_batch): those of a worse priority,
        and within its own, other tenants' groups the queue reaches only after the request.

        The queue serves the group of the least-served tenant next and charges it as it is sent
        (journey/coalesce.py): its request's tenant for its whole cost, and each tenant of another
        request waiting for its encodes for what that one still owes, until paid. So walking the
        queue in order and charging each group as it would be charged gives each group its place
        (start-time fair queueing's tags): a tenant served a little less than the request's goes
        first with only that little of its backlog, not with the whole of it. The request stands
        at its tenant's count (as if active now, so lifted to just under the floor) plus what its
        tenant's queued groups will be charged; a tie goes to the group queued first.

        The walk sees one encoder's queue, while a tenant's count rises with what every encoder
        is sent: a tenant queued on several encoders passes the request's count sooner than one
        queue shows, so the wait this predicts errs long by up to that factor, never short of
        what this queue alone would make it."""
        accounts, rank = self._accounts, self.rank
        account = accounts.get(tenant)
        floor = self._floor()
        own = account.encoder_v if account is not None else 0.0
        standing = own if floor is None or (account is not None and account.active) else _lifted(own, floor[0])

        def weight(name: str) -> float:
            other = accounts.get(name)
            return other.weight if other is not None else 1.0

        def later(waiting: Iterable[Any], fixed_s: float, item_s: float) -> list[Any]:
            # Each tenant's count as the queue is walked, and what each request's riders still owe.
            tags: dict[str, float] = {tenant: standing}
            owing: dict[int, dict[str, float]] = {}
            places: list[tuple[Any, float]] = []
            for work in waiting:
                if work.priority > priority:
                    places.append((work, math.inf))
                    continue
                owner, owed = work.tenant, work.owed
                cost = work.cost
                if owner is None:  # never charged (Lanes.charge), so it stays where it stands
                    at = rank(None)
                else:
                    at = tags.setdefault(owner, rank(owner))
                    tags[owner] = at + (fixed_s + item_s * cost) / weight(owner)
                rides = False
                if owed:
                    left = owing.setdefault(id(owed), dict(owed))
                    rides = tenant in left
                    for rider, paid in pay_riders(left, cost):
                        rider_at = tags.setdefault(rider, rank(rider))
                        at = min(at, rider_at)
                        tags[rider] = rider_at + (fixed_s + item_s * paid) / weight(rider)
                ahead = work.priority < priority or owner == tenant or rides
                places.append((work, -math.inf if ahead else at))
            # What the request's tenant is charged for its own queued groups comes before it.
            mine = tags[tenant]
            return [work for work, at in places if at > mine]

        return later

    def lead(self, tenant: str) -> tuple[float, float]:
        """How far `tenant` (as if active now) is ahead of the least-served active tenant."""
        account = self._accounts.get(tenant)
        floor = self._floor()
        if account is None or floor is None:
            return 0.0, 0.0
        return max(0.0, account.encoder_v - floor[0]), max(0.0, account.tokens_v - floor[1])

    def asked(self, tenant: str, weight: float, encoder_s: float, now: float) -> None:
        """A request of `tenant` arrived that asks `encoder_s` of the encoders."""
        account = self._account(tenant, weight)
        account.asking(now)
        account.asked_s += encoder_s

    def share(self, tenant: str, now: float | None = None, encoders: float = 0.0) -> str:
        """Whether `tenant` is over its share: it leads the least-served active tenant, or (given
        the clock `now` and the `encoders` this ledger's process may count on: with `--workers`,
        its part of them) asks more than its weighted share of them serves."""
        encoder, tokens = self.lead(tenant)
        if encoder > SLACK_S or tokens > SLACK_TOKENS:
            return OVER
        account = self._accounts.get(tenant)
        if account is None or now is None or encoders <= 0:
            return WITHIN
        # Its share among the tenants with requests in flight, itself counted as one of them.
        weights = sum(a.weight for name, a in self._accounts.items() if a.active and name != tenant)
        share = account.weight / (weights + account.weight)
        return OVER if account.asking(now) > (1 + DEMAND_SLACK) * share * encoders else WITHIN

    def view(
        self, names: tuple[str, ...], now: float | None = None, encoders: float = 0.0
    ) -> dict[str, dict[str, Any]]:
        """Each of `names` (the tenants file's) as /status.json shows it (`now` and `encoders` as
        `share` takes them)."""
        shown = {}
        for name in names:
            account = self._accounts.get(name)
            if account is None:
                continue
            encoder, tokens = self.lead(name)
            shown[name] = {
                "weight": account.weight,
                "inflight": account.active,
                "encoder_s": round(account.encoder_s, 3),
                "prompt_tokens": account.prompt_tokens,
                "output_tokens": account.output_tokens,
                "lead_encoder_s": round(encoder, 3),
                "lead_tokens": round(tokens, 1),
                "asked_encoder_s_per_s": round(account.asking(now), 3) if now is not None else None,
                "share": self.share(name, now, encoders),
            }
        return shown
