import { describe, expect, it, jest } from '@jest/globals';
import { execFile } from 'node:child_process';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { promisify } from 'node:util';
import { globalTime, withTimeout } from '../../lib/internal/time.js';
import { repoRoot } from '../support/paths.js';

const built = pathToFileURL(join(repoRoot, '.test-build', 'lib', 'internal', 'time.js')).href;

/** The bound every lock step is given (internal/time.ts). */
describe('withTimeout', () => {
  /**
   * Runs `body` in a Node process of its own, with `withTimeout` imported; resolves with the lines it
   * printed. `kept`: the process is kept alive while `body` runs (the bound's own timer is unref'd),
   * and prints the warnings Node emits.
   */
  const inProcess = async (body: string, kept = true) => {
    const script = kept
      ? `process.on('warning', (w) => console.log('warning', w.name));\nconst alive = setInterval(() => {}, 1_000);\n${body}\nclearInterval(alive);`
      : body;
    const run = await promisify(execFile)(process.execPath, ['--input-type=module', '-e', `import { withTimeout } from ${JSON.stringify(built)};\n${script}`], { timeout: 20_000 });
    return run.stdout.trim().split('\n');
  };

  it('rejects at its bound while nothing else happens in the process, not at the next thing that does', async () => {
    // A process of its own (withTimeout as the global setup compiled it), with nothing to do but a
    // bound of 100 ms on a promise that never settles, and a timer 3 s away: a rejection that
    // waited for something else to wake the process up would come with that timer.
    const out = await inProcess(
      `
      const started = performance.now();
      withTimeout(new Promise(() => {}), 100, () => new Error('the bound')).catch((e) => {
        console.log(e.message, Math.round(performance.now() - started));
        process.exit(0);
      });
      setTimeout(() => process.exit(1), 3000);
    `,
      false,
    );
    const [, message, ms] = /^(.*) (\d+)$/.exec(out.join('\n'))!;
    expect(message).toBe('the bound');
    expect(Number(ms)).toBeLessThan(1_500);
  });

  it('never keeps the process alive: a process whose only work is a bounded wait ends at once', async () => {
    // A 60 s bound on a promise that never settles, and nothing else: the process ends when its
    // script does (execFile gives up after 20 s).
    const out = await inProcess(
      `
      const started = performance.now();
      withTimeout(new Promise(() => {}), 60_000, () => new Error('the bound'));
      process.on('exit', () => console.log('ended after', Math.round(performance.now() - started)));
    `,
      false,
    );
    expect(Number(/^ended after (\d+)$/.exec(out.join('\n'))![1])).toBeLessThan(10_000);
  });

  it('calls onTimeout only at its bound: not after the promise settled, whether it resolved or rejected', async () => {
    // Both settle at once; the process then stays 3 bounds long, its own timer ordered after theirs.
    const out = await inProcess(`
      const late = (what) => () => (console.log('onTimeout after', what), new Error(what));
      await withTimeout(Promise.resolve(1), 100, late('resolved'));
      await withTimeout(Promise.reject(new Error('no')), 100, late('rejected')).catch(() => undefined);
      await new Promise((resolve) => setTimeout(resolve, 300));
      console.log('done');
    `);
    expect(out).toEqual(['done']);
  });

  it("swallows the late rejection of the promise it gave up on: no unhandled rejection", async () => {
    const out = await inProcess(`
      process.on('unhandledRejection', (e) => console.log('unhandled', e.message));
      let fail;
      const given = new Promise((_, reject) => (fail = reject));
      console.log(await withTimeout(given, 50, () => new Error('the bound')).catch((e) => e.message));
      fail(new Error('too late'));
      await new Promise((resolve) => setTimeout(resolve, 100));
      console.log('done');
    `);
    expect(out).toEqual(['the bound', 'done']);
  });

  it('rejects at once, with no warning from Node, for a bound already past (negative)', async () => {
    const out = await inProcess(`
      console.log(await withTimeout(new Promise(() => {}), -5, () => new Error('the bound')).catch((e) => e.message));
      await new Promise((resolve) => setTimeout(resolve, 50)); // a warning is emitted on the next tick
      console.log('done');
    `);
    expect(out).toEqual(['the bound', 'done']);
  });

  it('has no bound when given Infinity: the promise settles as it would', async () => {
    const out = await inProcess(`
      console.log(await withTimeout(new Promise((resolve) => setTimeout(() => resolve('settled'), 50)), Infinity, () => new Error('the bound')));
    `);
    expect(out).toEqual(['settled']);
  });

  it("on the globals' time (the memory store's), runs its rejection on a test's fake timers", async () => {
    jest.useFakeTimers();
    try {
      const bounded = withTimeout(new Promise(() => {}), 100, () => new Error('the bound'), globalTime);
      let outcome = 'pending';
      bounded.catch((e: Error) => (outcome = e.message));
      jest.advanceTimersByTime(100); // the bound's timer: it queues the rejection on setImmediate
      jest.runOnlyPendingTimers(); // the faked setImmediate: the rejection
      // Microtasks only: a real setImmediate would not have run yet.
      for (let i = 0; i < 3; i++) await Promise.resolve();
      expect(outcome).toBe('the bound');
    } finally {
      jest.useRealTimers();
    }
  });
});
