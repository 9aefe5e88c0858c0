import { describe, expect, it } from '@jest/globals';
import { execFile } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { promisify } from 'node:util';

const built = pathToFileURL(join(dirname(fileURLToPath(import.meta.url)), '..', '..', '.test-build', 'lib', 'internal', 'time.js')).href;

/** The bound every lock step is given (internal/time.ts). */
describe('withTimeout', () => {
  it('rejects at its bound while nothing else happens in the process, not at the next thing that does', async () => {
    // A process of its own (withTimeout as the global setup compiled it), with nothing to do but a
    // bound of 100 ms on a promise that never settles, and a timer 3 s away: a rejection that
    // waited for something else to wake the process up would come with that timer.
    const script = `
      import { withTimeout } from ${JSON.stringify(built)};
      const started = performance.now();
      withTimeout(new Promise(() => {}), 100, () => new Error('the bound')).catch((e) => {
        console.log(e.message, Math.round(performance.now() - started));
        process.exit(0);
      });
      setTimeout(() => process.exit(1), 3000);
    `;
    const { stdout } = await promisify(execFile)(process.execPath, ['--input-type=module', '-e', script]);
    const [, message, ms] = /^(.*) (\d+)$/.exec(stdout.trim())!;
    expect(message).toBe('the bound');
    expect(Number(ms)).toBeLessThan(1_500);
  });
});
