/**
 * Base class of every error nestjs-locked throws, so `catch (e) { if (e instanceof LockError) ... }`
 * separates lock problems from the rest. Each subclass has one meaning and a stable `name`.
 */
export class LockError extends Error {
  override name = 'LockError';

  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
  }
}
