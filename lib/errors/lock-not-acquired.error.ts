import { LockError } from './lock.error.js';

/** Why a lock could not be had. */
export type LockNotAcquiredReason =
  /** Another owner held the key for the whole of `waitMs`. */
  | 'timeout'
  /** Another owner held the key and the caller asked not to wait (`waitMs: 0`, `tryAcquire`, `onContention: 'fail'`). */
  | 'contended';

/**
 * Another owner holds the lock. Carries how long until the holder's current lease ends, which is
 * the earliest moment a retry can succeed without the holder releasing first.
 *
 * @example
 * try {
 *   await locks.acquire('report:daily', { waitMs: 0 });
 * } catch (e) {
 *   if (e instanceof LockNotAcquiredError) res.setHeader('Retry-After', Math.ceil(e.retryAfterMs / 1000));
 * }
 */
export class LockNotAcquiredError extends LockError {
  override name = 'LockNotAcquiredError';

  constructor(
    /** The lock's key, as the caller gave it. */
    readonly key: string,
    /** Milliseconds until the holder's lease ends (it may be renewed); `undefined` when unknown. */
    readonly retryAfterMs: number | undefined,
    /** How long this caller waited before giving up, in milliseconds. */
    readonly waitedMs: number,
    readonly reason: LockNotAcquiredReason,
  ) {
    super(
      `Lock "${key}" is held by another owner` +
        (reason === 'timeout' ? `; gave up after waiting ${Math.round(waitedMs)} ms` : ' and the caller chose not to wait') +
        (retryAfterMs === undefined ? '' : `. The holder's lease ends in ${retryAfterMs} ms unless renewed`) +
        '. Retry later, or raise waitMs if waiting longer is acceptable.',
    );
  }
}
