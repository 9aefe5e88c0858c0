// The other servers the suite also runs on: Redis 8 and Valkey 8, as Debian 13 (trixie) ships
// them. The machine's own redis-server (Redis 7.0 on Debian 12) runs every other line.
//
// Each server's binaries and the trixie libraries they were built against (trixie's C library is
// newer than Debian 12's) are fetched with `apt-get download` from Debian's archive into
// .tmp/servers/, unpacked without installing anything, and run through trixie's own dynamic loader.
// A directory of `redis-server` and `redis-cli` wrappers is put first on the PATH of the Jest run,
// so that every server a test starts is that one. Nothing on the machine changes: no package is
// installed, no service restarted.
//   import { otherServer, OTHER_SERVERS } from './redis-servers.mjs';
//   otherServer(OTHER_SERVERS[0]) → { name, version, bin }   (bin: the wrappers' directory)
//   node scripts/redis-servers.mjs [redis|valkey]          → prints the same as JSON
//   node scripts/redis-servers.mjs valkey -- npm run test:faults
//                                                         → runs the command on that server
//
// Where apt-get or Debian's archive is not at hand, set REDIS_8 or VALKEY_8 to a directory holding
// that server's binaries (`redis-server` and `redis-cli`, or `valkey-server` and `valkey-cli`).
//
// Two more kinds, fetched the same way: Redis 6.0 from Debian 11 (OLDER_REDIS, for the tests that
// an older Redis is refused) and the newest Redis and Valkey Debian has (NEWEST_SERVERS, for a run
// by hand, not in npm test or CI: `node scripts/redis-servers.mjs redis-newest -- npm run test:jest`).
import { execFileSync, spawnSync } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, renameSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { delimiter, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const dir = join(root, '.tmp', 'servers');

/** The Debian release the servers come from, and the archive's signing keys (Debian 12 has them). */
const SUITE = 'trixie';
const KEYRING = '/usr/share/keyrings/debian-archive-keyring.gpg';
const ARCHIVE = 'http://deb.debian.org/debian';

/**
 * The servers, each with the release line the run expects (what trixie ships when this was
 * written, 2026-11-28: Redis 8.0.2, Valkey 8.1.1; a point release of the same line is fine), the
 * package holding its binaries (the -server package only links to them) and the variable that
 * names a directory of binaries instead.
 */
export const OTHER_SERVERS = [
  { name: 'redis', label: 'Redis', line: '8.0', tools: 'redis-tools', server: 'redis-server', cli: 'redis-cli', variable: 'REDIS_8' },
  { name: 'valkey', label: 'Valkey', line: '8.1', tools: 'valkey-tools', server: 'valkey-server', cli: 'valkey-cli', variable: 'VALKEY_8' },
];

/**
 * A Redis older than nestjs-locked supports, for the test that its bootstrap refuses one on a real
 * server (test/core/module.spec.ts): Redis 6.0 as Debian 11 (bullseye) ships it (6.0.16), with the
 * bullseye libraries it links against that Debian 12 no longer has (OpenSSL 1.1, Debian's system
 * Lua 5.1 and its modules), run by the machine's own loader: a program built against an older C
 * library runs on a newer one. REDIS_6_0 names a directory of its binaries instead.
 *   node scripts/redis-servers.mjs redis6                  → { name, version, bin }
 */
export const OLDER_REDIS = {
  name: 'redis6',
  label: 'Redis',
  line: '6.0',
  tools: 'redis-tools',
  server: 'redis-server',
  cli: 'redis-cli',
  variable: 'REDIS_6_0',
  suite: 'bullseye',
  libraries: ['liblua5.1-0', 'lua-bitop', 'lua-cjson', 'libssl1.1', 'libjemalloc2', 'liblzf1'],
  loader: 'machine',
};

/**
 * The newest Redis and Valkey in Debian's archive, whatever their version (no `line`): Redis from
 * experimental, Valkey from unstable (sid), each with sid's libraries and loader. For a run by hand
 * on the newest servers; not in npm test or CI, as these suites change under a run from one week to
 * the next. Fetched once: remove .tmp/servers/<name> to fetch again.
 */
export const NEWEST_SERVERS = [
  { name: 'redis-newest', label: 'Redis', tools: 'redis-tools', server: 'redis-server', cli: 'redis-cli', variable: 'REDIS_NEWEST', suite: 'experimental', libsSuite: 'sid' },
  { name: 'valkey-newest', label: 'Valkey', tools: 'valkey-tools', server: 'valkey-server', cli: 'valkey-cli', variable: 'VALKEY_NEWEST', suite: 'sid' },
];

/** What the servers' binaries link against, from trixie (the loader comes with libc6). */
const LIBRARIES = ['libc6', 'libstdc++6', 'libgcc-s1', 'libssl3t64', 'libjemalloc2', 'liblzf1', 'libatomic1', 'libsystemd0', 'libcap2'];

const ALL_SERVERS = [...OTHER_SERVERS, OLDER_REDIS, ...NEWEST_SERVERS];

/** `server`'s wrappers' directory: from the directory its variable names, else fetched from Debian. */
export function otherServer(server) {
  const given = process.env[server.variable];
  const bin = join(dir, `${server.name}-bin`);
  if (given) {
    wrappers(bin, server, (binary) => [join(given, binary)]);
  } else {
    const { triplet, loader } = machine();
    const unpacked = fetched(server);
    const libs = join(dir, `${libsSuite(server)}-libs`, 'usr', 'lib', triplet);
    if (server.loader === 'machine') {
      // An older Debian's build: the machine's own loader, the older libraries found first.
      wrappers(bin, server, (binary) => ['env', `LD_LIBRARY_PATH=${libs}`, join(unpacked, 'usr', 'bin', binary)]);
    } else {
      // A newer Debian's build: its own loader and C library. --argv0: each binary decides what
      // to be by the name it was started under.
      wrappers(bin, server, (binary) => [join(libs, loader), '--library-path', libs, '--argv0', binary, join(unpacked, 'usr', 'bin', binary)]);
    }
  }
  return { name: server.name, version: checked(server, bin), bin };
}

/** Writes `redis-server` and `redis-cli` into `bin`, each exec'ing (so the pid stays the server's) what `command(binary)` gives for `server`'s binary of that role. */
function wrappers(bin, server, command) {
  mkdirSync(bin, { recursive: true });
  for (const [as, binary] of [
    ['redis-server', server.server],
    ['redis-cli', server.cli],
  ]) {
    // Written aside and moved over the old one: another process may be running it meanwhile.
    const file = join(bin, as);
    const written = `${file}.${process.pid}`;
    writeFileSync(written, `#!/bin/sh\nexec ${command(binary).map(quote).join(' ')} "$@"\n`);
    chmodSync(written, 0o755);
    renameSync(written, file);
  }
}

const quote = (word) => `'${word.replaceAll("'", `'\\''`)}'`;

/** Where Debian keeps this machine's libraries, and the name of its dynamic loader. */
function machine() {
  const machines = {
    x64: { triplet: 'x86_64-linux-gnu', loader: 'ld-linux-x86-64.so.2' },
    arm64: { triplet: 'aarch64-linux-gnu', loader: 'ld-linux-aarch64.so.1' },
  };
  const found = process.platform === 'linux' ? machines[process.arch] : undefined;
  if (!found) throw new Error(`Debian's server packages are fetched for Linux on x64 or arm64 only; on ${process.platform}-${process.arch}, set REDIS_8 and VALKEY_8 (scripts/redis-servers.mjs)`);
  return found;
}

/** The version `bin/redis-server --version` reports, which must be of the server's line (when it names one). */
function checked(server, bin) {
  const reported = execFileSync(join(bin, 'redis-server'), ['--version'], { encoding: 'utf8' }).trim();
  const version = new RegExp(`^${server.label} server v=(\\d+\\.\\d+\\.\\d+)`).exec(reported)?.[1];
  if (!version || (server.line && !version.startsWith(`${server.line}.`))) {
    throw new Error(`${bin}/redis-server reports "${reported}"; this run is for ${named(server)}${server.line ? '.x' : ''} (scripts/redis-servers.mjs)`);
  }
  const cli = execFileSync(join(bin, 'redis-cli'), ['--version'], { encoding: 'utf8' }).trim();
  if (!cli.includes(version)) throw new Error(`${bin}/redis-cli reports "${cli}", not ${server.label} ${version}`);
  return version;
}

/**
 * `server`'s tools package and its Debian release's libraries, unpacked under .tmp/servers/ once.
 * Each fetch works in a directory of its own and moves what it unpacked into place at the end, so
 * two processes fetching at once (two Jest workers whose tests both need the server) do not write
 * over each other: the first to finish wins, the other's copy is dropped.
 */
function fetched(server) {
  const suite = server.suite ?? SUITE;
  const unpacked = join(dir, server.name);
  const libs = join(dir, `${libsSuite(server)}-libs`);
  const hasServer = (at) => existsSync(join(at, 'usr', 'bin', server.server));
  const complete = (at) => existsSync(join(at, '.complete'));
  if (hasServer(unpacked) && complete(libs)) return unpacked;
  mkdirSync(dir, { recursive: true });
  const work = mkdtempSync(join(dir, '.fetch-'));
  try {
    // Package lists of the releases its packages come from (the libraries' and the tools').
    const apt = aptOptions([...new Set([libsSuite(server), suite])], join(work, 'apt'));
    execFileSync('apt-get', [...apt, 'update'], { stdio: ['ignore', 'pipe', 'pipe'] });
    if (!complete(libs)) {
      unpack(apt, libsSuite(server), server.libraries ?? LIBRARIES, join(work, 'libs'), join(work, 'downloads'));
      writeFileSync(join(work, 'libs', '.complete'), '');
      place(join(work, 'libs'), libs, complete);
    }
    if (!hasServer(unpacked)) {
      const tools = join(work, 'tools');
      unpack(apt, suite, [server.tools], tools, join(work, 'downloads'));
      // The -server package's binary is a link to the check tool, which acts on the name it runs under.
      symlinkSync(server.server.replace(/-server$/, '-check-rdb'), join(tools, 'usr', 'bin', server.server));
      place(tools, unpacked, hasServer);
    }
  } catch (error) {
    throw new Error(
      `could not fetch ${named(server)} from Debian's archive (${ARCHIVE}, ${suite}) with apt-get: ${error.stderr || error.message}\n` +
        `Install ${named(server)} another way and set ${server.variable} to the directory holding ${server.server} and ${server.cli}.`,
    );
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
  return unpacked;
}

/** `server` as messages name it: "Redis 8.0", or "the newest Valkey". */
const named = (server) => (server.line ? `${server.label} ${server.line}` : `the newest ${server.label}`);

/** The Debian release `server`'s libraries come from. */
const libsSuite = (server) => server.libsSuite ?? server.suite ?? SUITE;

/** Moves the directory `from` to `to`, unless another fetch got there first with one that `ready` accepts (a half-done one is replaced). */
function place(from, to, ready) {
  if (ready(to)) return;
  rmSync(to, { recursive: true, force: true });
  try {
    renameSync(from, to);
  } catch (error) {
    // Another fetch moved its copy there between the two steps above.
    if (!ready(to)) throw error;
  }
}

/**
 * apt-get options for package lists and a cache in `apt` (a fetch's own): the machine's package
 * sources are not read, and nothing of its apt state is written.
 */
function aptOptions(suites, apt) {
  mkdirSync(join(apt, 'lists', 'partial'), { recursive: true });
  mkdirSync(join(apt, 'cache', 'archives', 'partial'), { recursive: true });
  writeFileSync(join(apt, 'sources.list'), suites.map((suite) => `deb [signed-by=${KEYRING}] ${ARCHIVE} ${suite} main\n`).join(''));
  return [
    '-qq',
    '-o',
    `Dir::Etc::sourcelist=${join(apt, 'sources.list')}`,
    '-o',
    'Dir::Etc::sourceparts=-',
    '-o',
    `Dir::State::Lists=${join(apt, 'lists')}`,
    '-o',
    `Dir::Cache=${join(apt, 'cache')}`,
    '-o',
    'APT::Sandbox::User=root',
  ];
}

/** Downloads `packages` (`suite`'s versions) into `downloads` and unpacks each into `into`. */
function unpack(apt, suite, packages, into, downloads) {
  rmSync(downloads, { recursive: true, force: true });
  mkdirSync(downloads, { recursive: true });
  execFileSync('apt-get', [...apt, 'download', ...packages.map((p) => `${p}/${suite}`)], { cwd: downloads, stdio: ['ignore', 'pipe', 'pipe'] });
  mkdirSync(into, { recursive: true });
  for (const deb of readdirSync(downloads)) execFileSync('dpkg-deb', ['-x', join(downloads, deb), into]);
  rmSync(downloads, { recursive: true, force: true });
}

/**
 * What a run on `found` (otherServer's answer for `server`) adds to its environment: the wrappers
 * first on the PATH, and LOCK_TEST_SERVER, which the tests check the servers they start against.
 */
export function serverEnv(server, found) {
  return { PATH: `${found.bin}${delimiter}${process.env.PATH}`, LOCK_TEST_SERVER: `${server.label} ${found.version}` };
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  const args = process.argv.slice(2);
  const dash = args.indexOf('--');
  const names = dash < 0 ? args : args.slice(0, dash);
  const command = dash < 0 ? [] : args.slice(dash + 1);
  const unknown = names.filter((name) => !ALL_SERVERS.some((s) => s.name === name));
  if (unknown.length > 0 || (command.length > 0 && names.length !== 1)) {
    console.error(
      `usage: node scripts/redis-servers.mjs [${ALL_SERVERS.map((s) => s.name).join('|')}]          (fetch, print where)\n` +
        `       node scripts/redis-servers.mjs ${ALL_SERVERS.map((s) => s.name).join('|')} -- command  (run command on that server)`,
    );
    process.exit(2);
  }
  const wanted = names.length === 0 ? OTHER_SERVERS : ALL_SERVERS.filter((s) => names.includes(s.name));
  if (command.length === 0) {
    for (const server of wanted) console.log(JSON.stringify(otherServer(server)));
  } else {
    // `-- command`: runs it with the server's wrappers first on the PATH (the fault suite on Redis 8
    // and Valkey 8 in .ci/run; one spec by hand), and exits with its status.
    let env;
    try {
      env = serverEnv(wanted[0], otherServer(wanted[0]));
    } catch (error) {
      console.error(error.message);
      process.exit(1);
    }
    const result = spawnSync(command[0], command.slice(1), { stdio: 'inherit', env: { ...process.env, ...env } });
    if (result.error) console.error(result.error.message);
    process.exit(result.status ?? 1);
  }
}
