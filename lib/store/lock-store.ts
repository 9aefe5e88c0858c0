import type { Time } from '../internal/time.js';
/**
 * What LockService needs from a backend. Keys here are the caller's lock keys; a store decides how
 * they are named in its backend. Owners are opaque strings. Every method is one atomic step on the
 * backend; LockService adds waiting, renewal timing, contexts and events on top.
 */
export interface LockStore {
  /** Where the locks live, for messages (`redis 127.0.0.1:6379`). */
  readonly description: string;

  /** Resolves once the backend answers and is ready (scripts loaded); rejects after `timeoutMs`. */
  ready(timeoutMs: number): Promise<void>;

  /**
   * Starts connecting without waiting (bootstrap with `connectTimeoutMs: 0`): connections created
   * with ioredis's `lazyConnect` (nestjs-locked's own are) would otherwise wait for their first command.
   */
  connect?(): void;

  /** One acquisition attempt: a free lock or a re-entry is granted; otherwise reports the holder's remaining lease. */
  acquire(request: AcquireRequest): Promise<AcquireResult>;

  /**
   * Several exclusive locks in one atomic step, all or nothing, in the order given. Stores that
   * cannot (keys on several Cluster slots) leave it out, and LockService takes the keys one by
   * one in that order instead, rolling back on failure.
   */
  acquireMany?(keys: readonly string[], owner: string, leaseMs: number, holdsHere?: HoldsHere): Promise<AcquireManyResult>;

  /** Whether `acquireMany` can take these keys (default: yes); a Cluster store only when they share a slot. */
  groupsAtomically?(keys: readonly string[]): boolean;

  /**
   * Drops one hold of `owner` in `mode`. Returns the holds left (0: dropped), or -1 when `owner` held nothing.
   * `takeAlong`: the caller gives back its last hold of an exclusive lock taken in default mode (not
   * fair); a store may then let a waiter of this process try right behind the release, or hand it
   * the lock inside the release. Such a waiter takes a lock handed to it only once
   * `takeAlong.noticed` resolves: the caller resolves it once it has recorded the release (its
   * `released` event), so the release is always seen before the next holder's acquisition.
   * `holdsHere`: see AcquireRequest.holdsHere; asked once the reply is in, it counts the holds left
   * after this release.
   * `stillHeld`: the caller still holds the lock after this release (it gives back one hold of
   * several). Such a release never frees the lock, even where the backend counts the owner's last
   * hold: a backend that may run a step twice (Redis) can count fewer holds than the caller.
   */
  release(key: string, owner: string, mode?: LockMode, takeAlong?: TakeAlong, holdsHere?: HoldsHere, stillHeld?: boolean): Promise<number>;

  /** Drops every hold of `owner` in `mode` on `key` at once (after a loss, at shutdown). True when something was dropped. */
  releaseAll(key: string, owner: string, mode?: LockMode): Promise<boolean>;

  /** Renews the lease of each entry to at least its `leaseMs` (see `exact`) if its owner still holds it. One boolean per entry, in order. */
  renew(entries: readonly RenewRequest[]): Promise<boolean[]>;

  /**
   * Which renewals can share one `renew()` call and its fate (default: all of them). A Redis
   * Cluster store answers the key's slot, so that a master that is down fails the renewals of its
   * own slots only, never those of locks on the masters that answer.
   */
  renewalGroup?(key: string): number;

  /** The lock's state; `holdCount` is `owner`'s in `mode` (0 without an owner). */
  inspect(key: string, owner: string | undefined, mode?: LockMode): Promise<LockState>;

  /** Deletes the lock whoever holds it and wakes its waiters. True when there was one. */
  forceUnlock(key: string): Promise<boolean>;

  /**
   * A waiter gave up: takes `owner` out of the fair queue of `key` (handing a free lock to the next
   * waiter) and, for a writer, out of the waiting writers. A lock handed to the wait `waitId` of
   * `owner` (its ReleaseWatch's; none before it watched the key) and not taken over is given back:
   * the one hold the handover gave (other holds of `owner`, taken meanwhile, stay).
   */
  abandon(key: string, owner: string, mode: LockMode, fair: boolean, waitId?: string): Promise<void>;

  /**
   * Starts watching `key` for releases, for a wait of `owner` (fair mode wakes owners by name). The
   * watch must be `ready` before the next acquisition attempt, so that no release between that
   * attempt and `sleep()` goes unnoticed. `handoverLeaseMs`: an exclusive default-mode wait, which a
   * release of this process may hand the lock to with that lease (see ReleaseWatch.takeHandover);
   * stores that cannot ignore it.
   */
  watch(key: string, owner: string, handoverLeaseMs?: number): ReleaseWatch;

  /** False when fair mode cannot be offered (Redlock). Default true. */
  readonly supportsFairMode?: boolean;

  /**
   * True when every step bounds its own wait for the backend (Redlock: per node). Otherwise
   * LockService bounds the steps a caller awaits (release, extend, reads, force-unlock).
   */
  readonly boundsSteps?: boolean;

  /**
   * How long a step may wait for replicas once Redis ran it (replica confirmation: its own `WAIT`,
   * and one sent before it that blocks the connection). Bounds on steps add it. Default 0.
   */
  readonly confirmMs?: number;

  /**
   * The clock of local deadlines (leases, waits, renewals, `minHoldMs`) for locks of this store, and
   * the timers that wait for them (the watchdog, waits, the bounds on steps). Default: real time
   * (`node:perf_hooks` and `node:timers`, which fake timers leave alone), as Redis's leases run on
   * real time. The memory store, whose leases live in this process, uses the globals
   * (`performance.now()`, `setTimeout`), so that a test's fake timers move its leases and the timers
   * that wait for them alike.
   */
  readonly time?: Time;
  /** How much of a lease to take off local deadlines for clock drift (Redlock). Default 0. */
  driftMs?(leaseMs: number): number;

  /** Stops background work and closes connections this store opened. */
  close(): Promise<void>;
}

/** `exclusive`: a plain lock; `read` / `write`: the two sides of a read-write lock. */
export type LockMode = 'exclusive' | 'read' | 'write';

export interface AcquireRequest {
  key: string;
  owner: string;
  leaseMs: number;
  /** Default `exclusive`. */
  mode?: LockMode;
  /** First come, first served: refused attempts queue up (see the fair scripts). */
  fair?: boolean;
  /** Fair mode, and a refused writer (read-write mode): how long its place survives without a new attempt. */
  queueTimeoutMs?: number;
  /** Fair mode: the lease a release hands this owner the lock with (default min(leaseMs, queueTimeoutMs)). */
  handoverLeaseMs?: number;
  /**
   * Fair mode: the caller's `ReleaseWatch.waitId`, once it watches the key. A lock a release handed
   * to this wait, and not taken over yet, is returned as a grant of the hold the handover gave
   * instead of a re-entry (other holds of `owner`, taken meanwhile, stay theirs).
   */
  waitId?: string;
  /** See `HoldsHere`: asked once the reply is in, before this acquisition is counted. */
  holdsHere?: HoldsHere;
}

/**
 * How many holds the caller has of `key` in `mode` for `owner`, counted when asked; undefined when
 * other processes may use that owner too (an explicit owner), so that the caller cannot know. It
 * lets a store correct a step its backend ran twice: ioredis sends a command again when its
 * connection closed before the reply came, so an acquisition may count two holds, or a release drop two.
 */
export type HoldsHere = (owner: string, key: string, mode: LockMode) => number | undefined;

export type AcquireResult =
  | {
      granted: true;
      /** The owner's hold count after this acquisition (1 on a fresh grant). */
      holdCount: number;
      /** A fencing token: larger than every token issued before for this key. */
      fencingToken: number;
    }
  | {
      granted: false;
      /** The holder's remaining lease in ms; -1 when the key has no expiry. */
      ttlMs: number;
      /** The owner holds the read side and asked for the write side: refused, never waited for. */
      upgrade?: true;
      /** Fair mode: the key's latest fencing token when the attempt was refused (see `ReleaseWatch.forgetGrant`). */
      lastToken?: number;
    };

export type AcquireManyResult =
  | { granted: true; grants: { holdCount: number; fencingToken: number }[] }
  | { granted: false; /** The first key held by another owner. */ blockedBy: string; ttlMs: number };

export interface RenewRequest {
  key: string;
  owner: string;
  leaseMs: number;
  /** Default `exclusive`. */
  mode?: LockMode;
  /**
   * Set the lease to `leaseMs` even when that is shorter than what is left (extend(), minHoldMs's
   * last release), which a holder alone may. Without it (the watchdog) a renewal only lengthens the
   * lease: the lock's other holders, and the same owner in another process, count on it as it is.
   */
  exact?: boolean;
  /**
   * With `exact`: the lease is set shorter only while the owner counts at most this many holds in
   * the backend. LockService gives this process's holds of an owner given by name, which another
   * process may hold the lock under too: its holds count there, and it counts on the lease as it
   * is. Unset: no limit (an owner this process made, which no other process uses).
   */
  holdsAtMost?: number;
}

export interface LockState {
  locked: boolean;
  holdCount: number;
  /** Remaining lease in ms; -1 when the key has no expiry; -2 when it does not exist. */
  ttlMs: number;
}

/** A waiter's view of one key's releases. */
export interface ReleaseWatch {
  /** Resolves when releases of the key will be noticed, or when listening for them failed (see `listening`). */
  readonly ready: Promise<void>;
  /** Resolves with `ready`: true when the release channel is listened to, false when subscribing failed (waits then end by their timeouts only). */
  readonly listening: Promise<boolean>;
  /**
   * Sleeps until a release of the key wakes this waiter, `timeoutMs` passes, or `signal` aborts.
   * A release that happened since the previous sleep wakes it at once. `granted`: a fair release
   * handed the lock to this waiter's owner (`grantedToken` is its fencing token); it holds the lock
   * since a moment after the start of its latest attempt, with its handover lease.
   */
  sleep(timeoutMs: number, signal?: AbortSignal): Promise<'released' | 'timeout' | 'aborted' | 'granted'>;
  /** The fencing token of the grant that ended the latest sleep with `granted`. */
  readonly grantedToken?: number;
  /** Names this wait in fair-mode attempts, so a handover reaches this wait and no later one of the same owner. */
  readonly waitId: string;
  /**
   * An attempt of this wait was refused when the key's latest fencing token was `lastToken`: a
   * grant noticed with a token up to that one is void (had the lock been handed to this owner when
   * the attempt ran, the attempt would have returned it). Without `lastToken`, any grant noticed.
   */
  forgetGrant(lastToken?: number): void;
  /** Stops watching. `passWake`: this waiter was woken but will not try again, so wake the next one. */
  close(passWake?: boolean): void;
  /**
   * After a sleep that ended with `released`: when a release of this process that could hand this
   * wait the lock woke it, that release's verdict (once its reply is in): the grant, `unknown` when
   * the release failed (it may or may not have run), or undefined when it did not hand the lock to
   * this wait. Undefined when no such release woke it: the waiter attempts as usual.
   */
  takeHandover?(): Promise<Handover | undefined> | undefined;
}

/** See LockStore.release. */
export interface TakeAlong {
  readonly noticed: Promise<void>;
}

/** A lock a release handed to a waiter of the same process (see ReleaseWatch.takeHandover). */
export type Handover =
  | {
      /** The grant's fencing token. */
      fencingToken: number;
      /** Monotonic time the release was sent at: Redis set the waiter's lease after it. */
      leaseStart: number;
    }
  | 'unknown';
