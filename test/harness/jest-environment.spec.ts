// The suite fails a test on what Node would only print: run in a Jest of its own, with the suite's
// configuration (its test environment, test/support/jest-environment.mjs), each test of
// test/fixtures/jest-guard.fixture.ts passes or fails as the suite must decide.
import { describe, expect, it } from '@jest/globals';
import { execFile } from 'node:child_process';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { promisify } from 'node:util';
import { repoRoot } from '../support/paths.js';

interface JestReport {
  testResults: { message: string; assertionResults: { title: string; status: string; failureMessages: string[] }[] }[];
}

/** Each fixture test's status and failure messages, and under '(file)' the file's own message. */
async function runFixture(): Promise<Map<string, { status: string; message: string }>> {
  const jest = join(repoRoot, 'node_modules', 'jest', 'bin', 'jest.js');
  const { default: config } = (await import(pathToFileURL(join(repoRoot, 'jest.config.mjs')).href)) as { default: Record<string, unknown> };
  // The suite's own configuration, on the fixture alone; no global setup (it rebuilds .test-build,
  // which the suite's child processes read meanwhile).
  const own = { ...config, rootDir: repoRoot, roots: ['<rootDir>/test/fixtures'], testMatch: ['**/jest-guard.fixture.ts'], globalSetup: undefined, testPathIgnorePatterns: [] };
  const run = await promisify(execFile)(
    process.execPath,
    ['--experimental-vm-modules', '--disable-warning=ExperimentalWarning', jest, '--config', JSON.stringify(own), '--json', '--runInBand'],
    { cwd: repoRoot, timeout: 50_000, maxBuffer: 16 * 1024 * 1024 },
  ).catch((error: { stdout?: string }) => ({ stdout: error.stdout ?? '' })); // Jest exits 1: some tests fail, as they must
  const report = JSON.parse(run.stdout) as JestReport;
  return new Map(
    report.testResults.flatMap((file) => [
      ['(file)', { status: '', message: file.message }],
      ...file.assertionResults.map((a) => [a.title, { status: a.status, message: a.failureMessages.join('\n') }] as const),
    ]),
  );
}

describe('the suite fails a test on', () => {
  let results: Map<string, { status: string; message: string }>;
  const result = async (title: string) => {
    results ??= await runFixture();
    return results.get(title);
  };

  it('a DeprecationWarning, naming it', async () => {
    const r = await result('deprecation');
    expect(r?.status).toBe('failed');
    expect(r?.message).toContain('DeprecationWarning (DEP9999): guard fixture: this API is deprecated');
  });

  it('a MaxListenersExceededWarning', async () => {
    const r = await result('listener leak');
    expect(r?.status).toBe('failed');
    expect(r?.message).toContain('MaxListenersExceededWarning');
  });

  it('a DeprecationWarning that a fixture process printed, naming the fixture', async () => {
    const r = await result('fixture process deprecation');
    expect(r?.status).toBe('failed');
    expect(r?.message).toMatch(/fixture warning-child \(pid \d+\) printed: .*DeprecationWarning: guard fixture child: this API is deprecated/);
  });

  it('an unhandled rejection and an uncaught exception', async () => {
    expect((await result('unhandled rejection'))?.message).toContain('guard fixture: nobody catches this');
    expect((await result('uncaught exception'))?.message).toContain('guard fixture: nobody catches this either');
  });

  it('a failing warning or an unhandled rejection after the last test: the file fails', async () => {
    expect((await result('(file)'))?.message).toContain('DeprecationWarning (DEP9998): guard fixture: deprecated after the last test');
    expect((await result('(file)'))?.message).toContain('guard fixture: rejected after the last test');
  });

  it('nothing else: not on another warning, nor on a clean test', async () => {
    expect((await result('other warning'))?.status).toBe('passed');
    expect((await result('clean'))?.status).toBe('passed');
  });
});
