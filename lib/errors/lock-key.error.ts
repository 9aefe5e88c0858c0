import { LockError } from './lock.error.js';

/**
 * A lock key (or a decorator's key template, or an argument it reads) cannot make a valid key.
 * Thrown before anything is sent to Redis.
 */
export class LockKeyError extends LockError {
  override name = 'LockKeyError';

  constructor(
    message: string,
    /** The offending key or template, when there is one. */
    readonly key?: unknown,
  ) {
    super(message);
  }
}
