import { now, type Clock } from './internal/time.js';
import type { LockMode } from './store/lock-store.js';

/**
 * What this LockService knows about one lock it holds for one owner: shared by every handle of that
 * owner on that key (re-entries included). Internal.
 */
export class HeldLock {
  /** Handles of this service not yet released. The lock is given back when it reaches 0. */
  holds = 1;
  /** A renewal of this lock is in flight. */
  renewing = false;
  /** Monotonic time after which Redis may already have dropped the lock. */
  deadline = 0;
  /** Monotonic time at which the watchdog should renew it. */
  renewAt = Infinity;
  readonly acquiredAt: number;
  /**
   * Set when a `@Locked` call with `minHoldMs` took this lock fresh: at shutdown it is left in Redis
   * until then (on `clock`) instead of being taken back (see LockService.holdAtLeast).
   */
  keepUntil = 0;
  /** Created on first use: most locks are released without anyone reading their signal. */
  private controller: AbortController | undefined;
  /** Set once the lock is known to be lost (see `lost`), with the reason its signal aborts with. */
  private loss: { reason: unknown } | undefined;

  constructor(
    /** The map key of this record: `heldLockId(owner, key, mode)`. */
    readonly id: string,
    readonly key: string,
    readonly owner: string,
    public leaseMs: number,
    readonly watchdog: boolean,
    readonly fencingToken: number,
    leaseStart: number,
    readonly mode: LockMode = 'exclusive',
    /** Clock drift allowance to take off a lease's local deadline (Redlock). */
    private readonly drift: (leaseMs: number) => number = () => 0,
    /** Taken in fair mode. */
    readonly fair = false,
    /** The clock of its deadlines (LockStore.time). */
    private readonly clock: Clock = now,
  ) {
    this.acquiredAt = clock();
    this.setLease(leaseStart, leaseMs);
  }

  /** A lease of `leaseMs` was set in Redis by a command sent at monotonic time `start`. */
  setLease(start: number, leaseMs: number): void {
    this.leaseMs = leaseMs;
    this.deadline = start + leaseMs - this.drift(leaseMs);
    this.renewAt = this.watchdog ? start + leaseMs / 3 : Infinity;
  }

  /**
   * Redis holds this fresh grant for only `shortMs` from `start` (a fair handover): the deadline
   * follows that, and the watchdog renews it to the full lease within a third of it.
   */
  shortenFirstLease(start: number, shortMs: number): void {
    this.deadline = start + shortMs - this.drift(shortMs);
    if (this.watchdog) this.renewAt = start + shortMs / 3;
  }

  get signal(): AbortSignal {
    if (!this.controller) {
      this.controller = new AbortController();
      if (this.loss) this.controller.abort(this.loss.reason);
    }
    return this.controller.signal;
  }

  /** The lock is known to be lost; it is then forgotten and never renewed again. */
  get lost(): boolean {
    return this.loss !== undefined;
  }

  /** Marks the lock lost with `reason`: from now on its signal, once read, is aborted with it. */
  setLost(reason: unknown): void {
    this.loss = { reason };
  }

  /** Aborts the signal of a lock marked lost, if anyone has read it yet (else it is aborted when first read). */
  abort(): void {
    if (this.loss) this.controller?.abort(this.loss.reason);
  }

  get heldMs(): number {
    return this.clock() - this.acquiredAt;
  }
}

/**
 * The map key of a held lock: one record per (owner, key, mode). Owners and keys may contain any
 * character, so the owner's length goes in too: no two pairs join to the same string.
 */
export const heldLockId = (owner: string, key: string, mode: LockMode = 'exclusive'): string => `${mode} ${owner.length} ${owner}${key}`;
