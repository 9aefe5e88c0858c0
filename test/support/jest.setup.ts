import { afterAll, afterEach } from '@jest/globals';

/**
 * Any unhandled rejection or uncaught exception fails the test during which it happened (or the
 * file, if it happened after the last test). Without this, Jest may only print it, or miss it.
 */
const seen: unknown[] = [];
const record = (error: unknown) => seen.push(error);
process.on('unhandledRejection', record);
process.on('uncaughtException', record);

function failOnSeen(when: string): void {
  if (seen.length === 0) return;
  const errors = seen.splice(0);
  const details = errors.map((e) => (e instanceof Error ? e.stack ?? e.message : String(e))).join('\n---\n');
  throw new Error(`${errors.length} unhandled rejection(s)/uncaught exception(s) ${when}:\n${details}`);
}

afterEach(() => failOnSeen('during this test'));
afterAll(() => {
  process.off('unhandledRejection', record);
  process.off('uncaughtException', record);
  failOnSeen('after the last test of this file');
});
