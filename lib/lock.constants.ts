/** Injection token of the options given to `LockModule.forRoot()` / `forRootAsync()`. */
export const LOCK_MODULE_OPTIONS = Symbol('nestjs-locked:module-options');

/** Metadata key under which `@Locked` records its spec on the method it wraps. */
export const LOCKED_METADATA = Symbol('nestjs-locked:locked');

/** The default of `fairQueueTimeoutMs`, also used by a store given a fair or write request without one. */
export const DEFAULT_FAIR_QUEUE_TIMEOUT_MS = 5_000;
