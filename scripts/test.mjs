// `npm test`: everything the suite needs, in order, on a fresh clone after `npm install`.
//   1. stop at once if redis-server is missing (every lock test runs against a real Redis);
//   2. install the floor releases into compat/nest12 and compat/nest11 when missing or stale;
//   3. type-check lib, tests, sample and bench; build the dual ESM/CJS package;
//   4. run the Jest suite eight times: on the newest Nest 12 + ioredis 6 (root node_modules), on this
//      Node, on the newest Node pinned in scripts/node-floor.mjs (NEWEST_NODE) and on the newest
//      Node 22 and 24 pinned there (LTS_NODES); on Redis 8.0 and on Valkey 8.1 instead of the
//      machine's redis-server (scripts/redis-servers.mjs, from Debian's archive); on the
//      oldest Nest 12 with ioredis 6.0.0 (compat/nest12); on Nest 11.0.0 with ioredis 5.9.0
//      (compat/nest11). Both floor runs use rxjs 7.2.0 and reflect-metadata 0.1.13, and the oldest
//      Node the package's `engines` accepts (20.19.0). The fetched Nodes come from the npm registry
//      (scripts/node-floor.mjs);
//   5. end with a plain line "N passed, N failed" (tests of every run plus the checks above).
// Options: --only=12, --only=12-newest-node, --only=12-node22, --only=12-node24, --only=12-redis8,
// --only=12-valkey8, --only=12-floor or --only=11 runs one of the eight;
// arguments after -- go to Jest.
import { spawn, spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { floorNode, LTS_NODES, ltsNode, newestNode } from './node-floor.mjs';
import { OTHER_SERVERS, otherServer, serverEnv } from './redis-servers.mjs';

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

// The eight Jest runs: which major, which compat/ directory (none: the root's newest), which Node
// (`node`: which fetched one, and what it is; none: this Node), which server (`server`: another
// than the machine's redis-server, see scripts/redis-servers.mjs). The runs on a compat/ directory are
// the floor runs, and run on Node's floor.
const floor = { pick: floorNode, what: 'oldest accepted' };
const runs = [
  { name: '12', label: 'Nest 12', major: '12', compat: '' },
  { name: '12-newest-node', label: 'Nest 12, newest Node', major: '12', compat: '', node: { pick: newestNode, what: 'newest' } },
  ...LTS_NODES.map((version) => {
    const line = version.split('.')[0];
    return { name: `12-node${line}`, label: `Nest 12, Node ${line}`, major: '12', compat: '', node: { pick: () => ltsNode(version), what: version } };
  }),
  ...OTHER_SERVERS.map((server) => ({ name: `12-${server.name}8`, label: `Nest 12, ${server.label} ${server.line}`, major: '12', compat: '', server })),
  { name: '12-floor', label: 'Nest 12 floor', major: '12', compat: 'nest12', node: floor },
  { name: '11', label: 'Nest 11 floor', major: '11', compat: 'nest11', node: floor },
].filter((r) => !only || r.name === only);

// 2. The floors' side installs
for (const { compat: dir } of runs) {
  if (!dir) continue;
  const compat = join(root, 'compat', dir);
  const lock = readFileSync(join(compat, 'package-lock.json'));
  const stamp = join(compat, 'node_modules', '.installed-from');
  const hash = createHash('sha256').update(lock).digest('hex');
  if (!existsSync(stamp) || readFileSync(stamp, 'utf8') !== hash) {
    const ok = run(`install the floor releases into compat/${dir}`, 'npm', ['ci', '--omit=peer', '--no-audit', '--no-fund', '--prefix', compat]);
    if (ok) writeFileSync(stamp, hash);
    check(`compat/${dir} installed`, ok);
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

// 4. Jest: the newest Nest 12 on this Node, the newest and the LTS lines, then the floor runs on Node's floor.
const jest = join(root, 'node_modules', 'jest', 'bin', 'jest.js');
for (const { name, label, major, compat, node: fetched, server } of runs) {
  let node = { node: process.execPath, version: process.versions.node };
  // Another server than the machine's redis-server: its wrappers come first on the PATH.
  let path = {};
  if (server) {
    try {
      path = serverEnv(server, otherServer(server));
    } catch (error) {
      console.error(error.message);
      check(`${label}: ${server.label} ${server.line} fetched (scripts/redis-servers.mjs)`, false);
      continue;
    }
  }
  if (fetched) {
    try {
      node = fetched.pick();
    } catch (error) {
      console.error(error.message);
      check(`${label}: ${fetched.what} Node fetched (scripts/node-floor.mjs)`, false);
      continue;
    }
  }
  const out = join(tmp, `jest-nest${name}.json`);
  const { ok, output } = await runCapturing(
    `jest on ${label} (Node ${node.version}${path.LOCK_TEST_SERVER ? `, ${path.LOCK_TEST_SERVER}` : ''})`,
    node.node,
    ['--experimental-vm-modules', '--disable-warning=ExperimentalWarning', jest, '--json', `--outputFile=${out}`, ...jestArgs],
    { NEST_MAJOR: major, NEST_COMPAT: compat, CI: process.env.CI ?? '', ...path },
  );
  let report;
  try {
    report = JSON.parse(readFileSync(out, 'utf8'));
  } catch {
    check(`jest on ${label} produced a report`, false);
    continue;
  }
  passed += report.numPassedTests;
  failed += report.numFailedTests;
  // A suite that failed to run (syntax error, crash in a hook) has no failed tests but must fail the run.
  const brokenSuites = report.testResults.filter((r) => r.status === 'failed' && r.assertionResults.every((a) => a.status !== 'failed'));
  for (const suite of brokenSuites) check(`${label}: suite ${suite.name.slice(root.length + 1)} ran`, false);
  lines.push(`${ok ? 'ok  ' : 'FAIL'} jest on ${label}: ${report.numPassedTests} passed, ${report.numFailedTests} failed, ${report.numPendingTests} skipped`);
  if (report.numPendingTests > 0 || report.numTodoTests > 0) {
    check(`${label}: no skipped or todo tests`, false);
  }
  // Jest only warns about leaked handles; here they fail the run.
  const leaked = /failed to exit gracefully|did not exit one second|open handle/i.test(output);
  check(`${label}: no leaked handles (every worker exited cleanly)`, !leaked);
  if (!ok && report.numFailedTests === 0 && brokenSuites.length === 0) check(`jest on ${label} exited cleanly`, false);
}

finish();
