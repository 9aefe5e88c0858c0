import { LockError } from './lock.error.js';

/**
 * An option is missing, unknown or out of range. Thrown at bootstrap for module options, when a
 * class is defined for decorator options, and at the call for per-call options.
 */
export class LockConfigurationError extends LockError {
  override name = 'LockConfigurationError';

  constructor(
    /** The option's name, as a path (`leaseMs`, `redis`, `@Locked(...).waitMs`). */
    readonly option: string,
    message: string,
  ) {
    super(message);
  }
}
