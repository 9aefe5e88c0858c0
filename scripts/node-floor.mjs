// The oldest Node.js the package accepts (package.json `engines.node`, ">=20.19" → 20.19.0), and
// the newest one pinned here (NEWEST_NODE), for running tests on them. Node's own binaries are
// published on the npm registry as node-<platform>-<arch> (the packages behind npm's `node`
// package), so this needs nothing the install does not already need. Fetched once into
// .tmp/node-v<version>/.
//   import { floorNode, newestNode, ltsNode } from './node-floor.mjs'; floorNode() → { version, node, bin }
//   node scripts/node-floor.mjs [newest]         → prints { version, node, bin } as JSON
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');

/** The version the `engines.node` range starts at: ">=20.19" → "20.19.0". */
export function floorVersion() {
  const range = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')).engines?.node ?? '';
  const match = /^>=\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?$/.exec(range.trim());
  if (!match) throw new Error(`package.json engines.node must read ">=MAJOR.MINOR[.PATCH]" for the floor test; got ${JSON.stringify(range)}`);
  return `${match[1]}.${match[2] ?? 0}.${match[3] ?? 0}`;
}

/**
 * The newest Node release the suite also runs on (the newest on the npm registry when it was
 * pinned, 2026-11-26): the floor says what the package still accepts, this what most apps run.
 */
export const NEWEST_NODE = '26.12.1';

/**
 * The floor Node's binary, fetched from the npm registry on first use, or the one `NODE_FLOOR`
 * names (for platforms whose binaries the registry lacks: it has none for macOS on Arm after 18.9).
 */
export function floorNode() {
  return pinnedNode(floorVersion(), 'NODE_FLOOR');
}

/** The NEWEST_NODE binary, fetched like the floor's, or the one `NODE_NEWEST` names. */
export function newestNode() {
  return pinnedNode(NEWEST_NODE, 'NODE_NEWEST');
}

/**
 * The newest release of each long-term-support line between the floor and NEWEST_NODE when they
 * were pinned (2026-12-07, from the npm registry): the Nodes most applications run in production.
 */
export const LTS_NODES = ['22.23.5', '24.22.3'];

/** One of LTS_NODES, fetched like the floor's, or the binary `NODE_<major>` names (`NODE_22`). */
export function ltsNode(version) {
  return pinnedNode(version, `NODE_${version.split('.')[0]}`);
}

/** Node `version`: the binary the environment `variable` names, else the one fetched from the registry. */
function pinnedNode(version, variable) {
  if (process.env[variable]) return checked(version, process.env[variable]);
  return fetchedNode(version, variable);
}

/** Node `version` from the npm registry (node-<platform>-<arch>), kept in .tmp/node-v<version>/. */
function fetchedNode(version, variable) {
  const dir = join(root, '.tmp', `node-v${version}`);
  const node = process.platform === 'win32' ? join(dir, 'node.exe') : join(dir, 'bin', 'node');
  if (!existsSync(node)) {
    const platform = process.platform === 'win32' ? 'win' : process.platform;
    const spec = `node-${platform}-${process.arch}@${version}`;
    rmSync(dir, { recursive: true, force: true });
    mkdirSync(dir, { recursive: true });
    let packed;
    try {
      packed = JSON.parse(execFileSync('npm', ['pack', spec, '--json', '--pack-destination', dir], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] }));
    } catch (error) {
      throw new Error(
        `could not fetch Node ${version} (${spec}) from the npm registry: ${error.stderr || error.message}\n` +
          `Install Node ${version} another way (for example \`nvm install ${version}\`) and set ${variable} to its node binary.`,
      );
    }
    const tarball = join(dir, packed[0].filename);
    execFileSync('tar', ['xzf', tarball, '-C', dir, '--strip-components=1'], { stdio: 'inherit' });
    rmSync(tarball);
  }
  return checked(version, node);
}

function checked(version, node) {
  const reported = execFileSync(node, ['--version'], { encoding: 'utf8' }).trim();
  if (reported !== `v${version}`) throw new Error(`${node} reports ${reported}; the test needs v${version}`);
  return { version, node, bin: dirname(node) };
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) console.log(JSON.stringify(process.argv[2] === 'newest' ? newestNode() : floorNode()));
