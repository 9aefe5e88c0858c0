import { LockKeyError } from './errors/lock-key.error.js';
import { describe } from './lock-options.js';

/** The longest key accepted, in characters. Longer keys are almost always a key built from a whole object by mistake. */
export const MAX_KEY_LENGTH = 1024;

/**
 * Checks a lock key before anything reaches Redis. A key is a non-empty string of at most
 * `MAX_KEY_LENGTH` characters without `{` or `}`: nestjs-locked wraps every key in its own Cluster
 * hash tag (`lock:{key}`), and a brace inside would move the tag.
 */
export function assertLockKey(key: unknown, where: string): asserts key is string {
  if (typeof key !== 'string') {
    throw new LockKeyError(`${where}: a lock key must be a string; got ${describe(key)}.`, key);
  }
  if (key.length === 0) {
    throw new LockKeyError(`${where}: a lock key must not be empty.`, key);
  }
  if (key.length > MAX_KEY_LENGTH) {
    throw new LockKeyError(
      `${where}: a lock key must be at most ${MAX_KEY_LENGTH} characters; got ${key.length} (${describe(key)}).`,
      key,
    );
  }
  if (key.includes('{') || key.includes('}')) {
    throw new LockKeyError(
      `${where}: lock key ${describe(key)} contains "{" or "}". nestjs-locked puts every key in its own ` +
        'Cluster hash tag already; remove the braces (use ":" to separate parts).',
      key,
    );
  }
}

/**
 * The keys of a multi-key lock in their canonical order: each checked, duplicates dropped, sorted
 * by code unit. Every caller takes the same keys in this order, which is what rules out deadlock.
 */
export function canonicalKeys(keys: readonly unknown[], where: string): string[] {
  if (keys.length === 0) throw new LockKeyError(`${where}: a multi-key lock needs at least one key; got an empty array.`, keys);
  for (const key of keys) assertLockKey(key, where);
  return [...new Set(keys as string[])].sort();
}
