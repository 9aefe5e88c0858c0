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
import { execFileSync, spawnSync } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, readdirSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
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

/** What the servers' binaries link against, from trixie (the loader comes with libc6). */
const LIBRARIES = ['libc6', 'libstdc++6', 'libgcc-s1', 'libssl3t64', 'libjemalloc2', 'liblzf1', 'libatomic1', 'libsystemd0', 'libcap2'];

/** `server`'s wrappers' directory: from the directory its variable names, else fetched from Debian. */
export function otherServer(server) {
  const given = process.env[server.variable];
  const bin = join(dir, `${server.name}-bin`);
  if (given) {
    wrappers(bin, server, (binary) => [join(given, binary)]);
  } else {
    const { triplet, loader } = machine();
    const unpacked = fetched(server);
    const libs = join(dir, 'trixie-libs', 'usr', 'lib', triplet);
    // --argv0: each binary decides what to be by the name it was started under.
    wrappers(bin, server, (binary) => [join(libs, loader), '--library-path', libs, '--argv0', binary, join(unpacked, 'usr', 'bin', binary)]);
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
    const file = join(bin, as);
    writeFileSync(file, `#!/bin/sh\nexec ${command(binary).map(quote).join(' ')} "$@"\n`);
    chmodSync(file, 0o755);
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

/** The version `bin/redis-server --version` reports, which must be of the server's line. */
function checked(server, bin) {
  const reported = execFileSync(join(bin, 'redis-server'), ['--version'], { encoding: 'utf8' }).trim();
  const version = new RegExp(`^${server.label} server v=(\\d+\\.\\d+\\.\\d+)`).exec(reported)?.[1];
  if (!version || !version.startsWith(`${server.line}.`)) {
    throw new Error(`${bin}/redis-server reports "${reported}"; this run is for ${server.label} ${server.line}.x (scripts/redis-servers.mjs)`);
  }
  const cli = execFileSync(join(bin, 'redis-cli'), ['--version'], { encoding: 'utf8' }).trim();
  if (!cli.includes(version)) throw new Error(`${bin}/redis-cli reports "${cli}", not ${server.label} ${version}`);
  return version;
}

/** `server`'s tools package and trixie's libraries, unpacked under .tmp/servers/ once. */
function fetched(server) {
  const unpacked = join(dir, server.name);
  const libs = join(dir, 'trixie-libs');
  if (existsSync(join(unpacked, 'usr', 'bin', server.server)) && existsSync(join(libs, '.complete'))) return unpacked;
  try {
    const apt = aptOptions();
    execFileSync('apt-get', [...apt, 'update'], { stdio: ['ignore', 'pipe', 'pipe'] });
    if (!existsSync(join(libs, '.complete'))) {
      unpack(apt, LIBRARIES, libs);
      writeFileSync(join(libs, '.complete'), '');
    }
    unpack(apt, [server.tools], unpacked);
  } catch (error) {
    throw new Error(
      `could not fetch ${server.label} ${server.line} from Debian's archive (${ARCHIVE}, ${SUITE}) with apt-get: ${error.stderr || error.message}\n` +
        `Install ${server.label} ${server.line} another way and set ${server.variable} to the directory holding ${server.server} and ${server.cli}.`,
    );
  }
  // The -server package's binary is a link to the check tool, which acts on the name it runs under.
  const binaries = join(unpacked, 'usr', 'bin');
  if (!existsSync(join(binaries, server.server))) symlinkSync(`${server.name}-check-rdb`, join(binaries, server.server));
  return unpacked;
}

/**
 * apt-get options for package lists and a cache of their own under .tmp/servers/apt: the machine's
 * package sources are not read, and nothing of its apt state is written.
 */
function aptOptions() {
  const apt = join(dir, 'apt');
  mkdirSync(join(apt, 'lists', 'partial'), { recursive: true });
  mkdirSync(join(apt, 'cache', 'archives', 'partial'), { recursive: true });
  writeFileSync(join(apt, 'sources.list'), `deb [signed-by=${KEYRING}] ${ARCHIVE} ${SUITE} main\n`);
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

/** Downloads `packages` (trixie's versions) and unpacks each into `into`. */
function unpack(apt, packages, into) {
  const downloads = join(dir, 'downloads');
  rmSync(downloads, { recursive: true, force: true });
  mkdirSync(downloads, { recursive: true });
  execFileSync('apt-get', [...apt, 'download', ...packages.map((p) => `${p}/${SUITE}`)], { cwd: downloads, stdio: ['ignore', 'pipe', 'pipe'] });
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
  const unknown = names.filter((name) => !OTHER_SERVERS.some((s) => s.name === name));
  if (unknown.length > 0 || (command.length > 0 && names.length !== 1)) {
    console.error(
      'usage: node scripts/redis-servers.mjs [redis|valkey]          (fetch, print where)\n' +
        '       node scripts/redis-servers.mjs redis|valkey -- command  (run command on that server)',
    );
    process.exit(2);
  }
  const wanted = OTHER_SERVERS.filter((s) => names.length === 0 || names.includes(s.name));
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
