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

  /** One acquisition attempt: a free lock or a re-entry is granted; otherwise reports the holder's remaining lease. */
  acquire(request: AcquireRequest): Promise<AcquireResult>;

  /**
   * Several exclusive locks in one atomic step, all or nothing, in the order given. Stores that
   * cannot (keys on several Cluster slots) leave it out, and LockService takes the keys one by
   * one in that order instead, rolling back on failure.
   */
  acquireMany?(keys: readonly string[], owner: string, leaseMs: number): Promise<AcquireManyResult>;

  /** Whether `acquireMany` can take these keys (default: yes); a Cluster store only when they share a slot. */
  groupsAtomically?(keys: readonly string[]): boolean;

  /** Drops one hold of `owner` in `mode`. Returns the holds left (0: dropped), or -1 when `owner` held nothing. */
  release(key: string, owner: string, mode?: LockMode): Promise<number>;

  /** Drops every hold of `owner` in `mode` on `key` at once (after a loss, at shutdown). True when something was dropped. */
  releaseAll(key: string, owner: string, mode?: LockMode): Promise<boolean>;

  /** Sets the lease of each entry to its `leaseMs` if its owner still holds it. One boolean per entry, in order. */
  renew(entries: readonly RenewRequest[]): Promise<boolean[]>;

  /** The lock's state; `holdCount` is `owner`'s in `mode` (0 without an owner). */
  inspect(key: string, owner: string | undefined, mode?: LockMode): Promise<LockState>;

  /** Deletes the lock whoever holds it and wakes its waiters. True when there was one. */
  forceUnlock(key: string): Promise<boolean>;

  /**
   * A waiter gave up: takes `owner` out of the fair queue of `key` (waking the next waiter if
   * needed) and, for a writer, out of the waiting writers.
   */
  abandon(key: string, owner: string, mode: LockMode, fair: boolean): Promise<void>;

  /**
   * Starts watching `key` for releases, as `owner` (fair mode wakes owners by name). The watch
   * must be `ready` before the next acquisition attempt, so that no release between that attempt
   * and `sleep()` goes unnoticed.
   */
  watch(key: string, owner: string): ReleaseWatch;

  /** False when fair mode cannot be offered (Redlock). Default true. */
  readonly supportsFairMode?: boolean;

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
  /** Fair mode: how long a queued place survives without a new attempt. */
  queueTimeoutMs?: number;
}

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
}

export interface LockState {
  locked: boolean;
  holdCount: number;
  /** Remaining lease in ms; -1 when the key has no expiry; -2 when it does not exist. */
  ttlMs: number;
}

/** A waiter's view of one key's releases. */
export interface ReleaseWatch {
  /** Resolves when releases of the key will be noticed. */
  readonly ready: Promise<void>;
  /**
   * Sleeps until a release of the key wakes this waiter, `timeoutMs` passes, or `signal` aborts.
   * A release that happened since the previous sleep wakes it at once.
   */
  sleep(timeoutMs: number, signal?: AbortSignal): Promise<'released' | 'timeout' | 'aborted'>;
  /** Stops watching. `passWake`: this waiter was woken but will not try again, so wake the next one. */
  close(passWake?: boolean): void;
}
