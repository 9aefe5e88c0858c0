// `npm test`: everything the suite needs, in order, on a fresh clone after `npm install`.
//   1. stop at once if redis-server is missing (every lock test runs against a real Redis);
//   2. install Nest 11 + ioredis 5 into compat/nest11 when missing or stale;
//   3. type-check lib, tests, sample and bench; build the dual ESM/CJS package;
//   4. run the Jest suite on Nest 12 + ioredis 6, then on Nest 11 + ioredis 5;
//   5. end with a plain line "N passed, N failed" (tests of both runs plus the checks above).
// Options: --only=12 or --only=11 runs one major; arguments after -- go to Jest.
import { spawn, spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const tmp = join(root, '.tmp');
mkdirSync(tmp, { recursive: true });
const argv = process.argv.slice(2);
const only = argv.find((a) => a.startsWith('--only='))?.slice('--only='.length);
const jestArgs = argv.includes('--') ? argv.slice(argv.indexOf('--') + 1) : [];

let passed = 0;
let failed = 0;
const lines = [];

function run(label, command, args, env = {}) {
  console.log(`\n=== ${label}`);
  const result = spawnSync(command, args, { cwd: root, stdio: 'inherit', env: { ...process.env, ...env } });
  return result.status === 0;
}

/** Like run(), but also returns what the command printed (streamed through as it runs). */
function runCapturing(label, command, args, env = {}) {
  console.log(`\n=== ${label}`);
  return new Promise((resolve) => {
    const child = spawn(command, args, { cwd: root, stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env } });
    let output = '';
    child.stdout.on('data', (d) => (process.stdout.write(d), (output += d)));
    child.stderr.on('data', (d) => (process.stderr.write(d), (output += d)));
    child.on('close', (code) => resolve({ ok: code === 0, output }));
  });
}

function check(label, ok) {
  if (ok) passed++;
  else failed++;
  lines.push(`${ok ? 'ok  ' : 'FAIL'} ${label}`);
}

function finish() {
  console.log('\n=== summary');
  for (const line of lines) console.log(line);
  const summary = `${passed} passed, ${failed} failed`;
  writeFileSync(join(tmp, 'test-summary.txt'), summary + '\n');
  console.log(summary);
  process.exit(failed === 0 ? 0 : 1);
}

// 1. Redis
if (spawnSync('redis-server', ['--version'], { stdio: 'ignore' }).status !== 0) {
  console.error(
    'redis-server is not installed, and every lock test runs against a real Redis that the tests start themselves.\n' +
      'Install it, then run `npm test` again:\n' +
      '  Debian/Ubuntu: sudo apt-get install -y redis-server\n' +
      '  macOS:         brew install redis',
  );
  check('redis-server installed', false);
  finish();
}

// 2. Nest 11 + ioredis 5 side install
if (only !== '12') {
  const compat = join(root, 'compat', 'nest11');
  const lock = readFileSync(join(compat, 'package-lock.json'));
  const stamp = join(compat, 'node_modules', '.installed-from');
  const hash = createHash('sha256').update(lock).digest('hex');
  if (!existsSync(stamp) || readFileSync(stamp, 'utf8') !== hash) {
    const ok = run('install Nest 11 + ioredis 5 into compat/nest11', 'npm', ['ci', '--omit=peer', '--no-audit', '--no-fund', '--prefix', compat]);
    if (ok) writeFileSync(stamp, hash);
    check('compat/nest11 installed', ok);
    if (!ok) finish();
  }
}

// 3. Type check and build
const tsc = join(root, 'node_modules', 'typescript', 'bin', 'tsc');
check('type check (tsc --noEmit: lib, test, sample, bench)', run('type check', process.execPath, [tsc, '-p', 'tsconfig.json']));
check('dual ESM/CJS build', run('build', process.execPath, [join(root, 'scripts', 'build.mjs')]));
check(
  'API reference (TypeDoc into docs/api, warnings are errors)',
  run('API reference', process.execPath, [join(root, 'node_modules', 'typedoc', 'bin', 'typedoc'), '--logLevel', 'Warn']),
);

// 4. Jest on each major
const jest = join(root, 'node_modules', 'jest', 'bin', 'jest.js');
for (const major of ['12', '11']) {
  if (only && only !== major) continue;
  const out = join(tmp, `jest-nest${major}.json`);
  const { ok, output } = await runCapturing(
    `jest on Nest ${major}`,
    process.execPath,
    ['--experimental-vm-modules', '--disable-warning=ExperimentalWarning', jest, '--json', `--outputFile=${out}`, ...jestArgs],
    { NEST_MAJOR: major, CI: process.env.CI ?? '' },
  );
  let report;
  try {
    report = JSON.parse(readFileSync(out, 'utf8'));
  } catch {
    check(`jest on Nest ${major} produced a report`, false);
    continue;
  }
  passed += report.numPassedTests;
  failed += report.numFailedTests;
  // A suite that failed to run (syntax error, crash in a hook) has no failed tests but must fail the run.
  const brokenSuites = report.testResults.filter((r) => r.status === 'failed' && r.assertionResults.every((a) => a.status !== 'failed'));
  for (const suite of brokenSuites) check(`Nest ${major}: suite ${suite.name.slice(root.length + 1)} ran`, false);
  lines.push(`${ok ? 'ok  ' : 'FAIL'} jest on Nest ${major}: ${report.numPassedTests} passed, ${report.numFailedTests} failed, ${report.numPendingTests} skipped`);
  if (report.numPendingTests > 0 || report.numTodoTests > 0) {
    check(`Nest ${major}: no skipped or todo tests`, false);
  }
  // Jest only warns about leaked handles; here they fail the run.
  const leaked = /failed to exit gracefully|did not exit one second|open handle/i.test(output);
  check(`Nest ${major}: no leaked handles (every worker exited cleanly)`, !leaked);
  if (!ok && report.numFailedTests === 0 && brokenSuites.length === 0) check(`jest on Nest ${major} exited cleanly`, false);
}

finish();
