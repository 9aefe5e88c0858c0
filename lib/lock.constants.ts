/** Injection token of the options given to `LockModule.forRoot()` / `forRootAsync()`. */
export const LOCK_MODULE_OPTIONS = Symbol('nestjs-locked:module-options');

/** Metadata key under which `@Locked` records its spec on the method it wraps. */
export const LOCKED_METADATA = Symbol('nestjs-locked:locked');
