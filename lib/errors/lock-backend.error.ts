import { LockError } from './lock.error.js';

/**
 * Redis failed or could not be reached while doing `operation`, or the lock module has shut down.
 * The original error is `cause`. No lock state was changed by the failed call unless Redis
 * executed it before the failure was reported; the lease bounds how long such a lock can stay.
 */
export class LockBackendError extends LockError {
  override name = 'LockBackendError';

  constructor(
    readonly operation: string,
    readonly key: string | undefined,
    cause: unknown,
    /** The whole message, where the default ("Redis failed during ...") would mislead. */
    message?: string,
  ) {
    super(
      message ??
        `Redis failed during ${operation}${key === undefined ? '' : ` of "${key}"`}: ${
          // ioredis's own messages end with a period ("Connection is closed.").
          (cause instanceof Error ? cause.message : String(cause)).replace(/\.$/, '')
        }. Check that Redis is reachable and that the lock keys are not used by other code.`,
      { cause },
    );
  }
}
