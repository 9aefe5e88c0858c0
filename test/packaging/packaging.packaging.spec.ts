import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { execFileSync, spawnSync } from 'node:child_process';
import { cpSync, mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { delimiter, join } from 'node:path';
import { RedisServer } from '../support/redis-server.js';
import { repoRoot as root } from '../support/paths.js';

/**
 * Packaging proven from the outside (`npm run test:packaging`): the library is packed with
 * `npm pack` and the tarball installed into three fresh apps, which type-check and run their own
 * tests: a Nest 11 app in CommonJS (jest in CommonJS mode, ts-jest), a Nest 12 app in ES modules
 * (jest in native ESM mode) and a Nest 12 app in CommonJS (tsc, then plain Node's test runner:
 * Nest 12 is ESM-only, so that app and the package's CommonJS build load it with require(esm)).
 * Each app's tests run three times: on this Node, on the newest Node pinned in scripts/node-floor.mjs
 * (26.12.1), and on the oldest Node the package's `engines` accepts (20.19.0), both fetched from the
 * npm registry by scripts/node-floor.mjs. Each app is also type-checked with every TypeScript major
 * in TYPESCRIPTS, whichever one it pins itself. Needs the npm registry.
 */
const work = join(root, '.tmp', 'packaging');
const pathKey = Object.keys(process.env).find((k) => k.toUpperCase() === 'PATH') ?? 'PATH';
const run = (cwd: string, command: string, args: string[], env: Record<string, string> = {}) => {
  const result = spawnSync(command, args, { cwd, encoding: 'utf8', env: { ...process.env, ...env }, timeout: 300_000 });
  return { ok: result.status === 0, output: `${result.stdout}\n${result.stderr}` };
};

/**
 * A date at which the registry resolved both apps' dependencies (checked 2026-11-24). Used only
 * when the registry as it is now cannot be resolved: a package published with a dependency the
 * registry (or its mirror) does not have yet. On 2026-11-24, @babel/types 7.29.15 required
 * @babel/helper-string-parser ^7.29.15, which the mirror of these machines lacked (ETARGET).
 */
const RESOLVABLE_REGISTRY_DATE = '2026-11-18';

/**
 * `npm install` as a new user would run it, resolving every range afresh; if the registry cannot
 * satisfy a range (ETARGET, which is not ours to fix), again with the registry as it was on
 * RESOLVABLE_REGISTRY_DATE (npm's `--before`), saying so.
 */
function installFresh(dir: string): { ok: boolean; output: string } {
  const args = ['install', '--no-audit', '--no-fund', '--loglevel=error'];
  const fresh = run(dir, 'npm', args);
  if (fresh.ok || !/\bETARGET\b/.test(fresh.output)) return fresh;
  process.stderr.write(`packaging: the registry cannot resolve today's versions (${/notarget (.*)/.exec(fresh.output)?.[1] ?? 'ETARGET'}); installing as of ${RESOLVABLE_REGISTRY_DATE}\n`);
  rmSync(join(dir, 'node_modules'), { recursive: true, force: true });
  rmSync(join(dir, 'package-lock.json'), { force: true });
  return run(dir, 'npm', [...args, `--before=${RESOLVABLE_REGISTRY_DATE}`]);
}

/**
 * The TypeScripts whose type check of each app must pass, installed side by side under npm aliases:
 * 5.9 (what Nest 11 apps were made with), 6 (what `nest new` scaffolds on Nest 12: @nestjs/schematics
 * 12.0.6 asks for ^6.0.2, which the Nest 12 apps pin) and 7. The Nest 11 app's tsconfig names no
 * `moduleResolution`, so it resolves the package as CommonJS apps get by default: node10 on 5.9,
 * bundler on 6 and 7 (6 deprecates node10, 7 refuses it).
 */
const TYPESCRIPTS: Record<string, string> = { 'typescript-5': 'npm:typescript@~5.9.3', 'typescript-6': 'npm:typescript@^6.0.2', 'typescript-7': 'npm:typescript@^7.0.2' };

/** How each app's own test runner says that its one test passed. */
const passedOne: Record<string, RegExp[]> = {
  'nest11-cjs': [/Tests:\s+1 passed, 1 total/],
  'nest12-esm': [/Tests:\s+1 passed, 1 total/],
  // Node's test runner prints TAP when its output is not a terminal on Node 20, its spec reporter on 26.
  'nest12-cjs': [/^(?:# |ℹ )pass 1$/m, /^(?:# |ℹ )fail 0$/m],
};

describe('the packed package in fresh apps', () => {
  let redis: RedisServer;
  let files: string[] = [];
  let floor: { version: string; bin: string };
  let newest: { version: string; bin: string };
  /** `tsc` of each of TYPESCRIPTS, by its version. */
  let typescripts: { version: string; tsc: string }[] = [];
  beforeAll(async () => {
    floor = JSON.parse(execFileSync(process.execPath, [join(root, 'scripts', 'node-floor.mjs')], { cwd: root, encoding: 'utf8' })) as typeof floor;
    newest = JSON.parse(execFileSync(process.execPath, [join(root, 'scripts', 'node-floor.mjs'), 'newest'], { cwd: root, encoding: 'utf8' })) as typeof newest;
    rmSync(work, { recursive: true, force: true });
    mkdirSync(work, { recursive: true });
    execFileSync(process.execPath, [join(root, 'scripts', 'build.mjs')], { cwd: root, stdio: 'ignore' });
    const packed = JSON.parse(execFileSync('npm', ['pack', '--json', '--pack-destination', work], { cwd: root, encoding: 'utf8' })) as {
      filename: string;
      files: { path: string }[];
    }[];
    files = packed[0]!.files.map((f) => f.path);
    cpSync(join(work, packed[0]!.filename), join(work, 'nestjs-locked.tgz'));
    const tsDir = join(work, 'typescript');
    mkdirSync(tsDir);
    writeFileSync(join(tsDir, 'package.json'), JSON.stringify({ name: 'typescripts', private: true, dependencies: TYPESCRIPTS }));
    const tsInstall = installFresh(tsDir);
    if (!tsInstall.ok) throw new Error(`installing ${Object.values(TYPESCRIPTS).join(', ')} failed:\n${tsInstall.output}`);
    typescripts = Object.keys(TYPESCRIPTS).map((alias) => ({
      version: (JSON.parse(readFileSync(join(tsDir, 'node_modules', alias, 'package.json'), 'utf8')) as { version: string }).version,
      tsc: join(tsDir, 'node_modules', alias, 'bin', 'tsc'),
    }));
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  it('ships only the two builds with their types, the README, the changelog, the licence and package.json; no ioredis inside', () => {
    expect(files.filter((f) => !/^dist\/(esm|cjs)\//.test(f)).sort()).toEqual(['CHANGELOG.md', 'LICENSE', 'README.md', 'package.json']);
    expect(files).toEqual(expect.arrayContaining(['dist/esm/index.js', 'dist/esm/index.d.ts', 'dist/cjs/index.js', 'dist/cjs/index.d.ts', 'dist/esm/package.json', 'dist/cjs/package.json']));
    expect(files.some((f) => f.includes('node_modules') || f.includes('ioredis'))).toBe(false);
    const manifest = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')) as { dependencies?: object; peerDependencies: Record<string, string> };
    expect(manifest.dependencies ?? {}).toEqual({});
    expect(manifest.peerDependencies).toMatchObject({ '@nestjs/common': '^11.0.0 || ^12.0.0', '@nestjs/core': '^11.0.0 || ^12.0.0', ioredis: '^5.9.0 || ^6.0.0', rxjs: '^7.2.0' });
  });

  for (const app of Object.keys(passedOne)) {
    it(`installs into a fresh ${app} app, whose types resolve on TypeScript 5.9, 6 and 7 and whose own tests pass on this Node, on the newest Node and on the oldest Node the package accepts`, () => {
      const dir = join(work, app);
      cpSync(join(root, 'test', 'packaging', 'apps', app), dir, { recursive: true });
      const install = installFresh(dir);
      expect({ step: 'npm install', ok: install.ok, output: install.ok ? '' : install.output }).toEqual({ step: 'npm install', ok: true, output: '' });
      const typecheck = run(dir, 'npm', ['run', 'typecheck']);
      expect({ step: 'tsc --noEmit', ok: typecheck.ok, output: typecheck.ok ? '' : typecheck.output }).toEqual({ step: 'tsc --noEmit', ok: true, output: '' });
      expect(typescripts.map(({ version }) => version.split('.')[0])).toEqual(['5', '6', '7']);
      for (const { version, tsc } of typescripts) {
        const step = `tsc --noEmit with TypeScript ${version}`;
        const check = run(dir, process.execPath, [tsc, '--noEmit', '-p', 'tsconfig.json']);
        expect({ step, ok: check.ok, output: check.ok ? '' : check.output }).toEqual({ step, ok: true, output: '' });
      }
      const nodes = [
        { step: `app tests on Node ${process.versions.node}`, version: process.version, env: {} },
        { step: `app tests on Node ${newest.version}`, version: `v${newest.version}`, env: { [pathKey]: `${newest.bin}${delimiter}${process.env[pathKey] ?? ''}` } },
        { step: `app tests on Node ${floor.version}`, version: `v${floor.version}`, env: { [pathKey]: `${floor.bin}${delimiter}${process.env[pathKey] ?? ''}` } },
      ];
      for (const { step, version, env } of nodes) {
        // The `node` that npm's scripts and the apps' bin shims start is the first on PATH.
        expect([step, run(dir, 'node', ['--version'], env).output.trim()]).toEqual([step, version]);
        const tests = run(dir, 'npm', ['test'], { ...env, REDIS_URL: redis.url });
        expect({ step, ok: tests.ok, output: tests.ok ? '' : tests.output }).toEqual({ step, ok: true, output: '' });
        for (const pattern of passedOne[app]!) expect([step, tests.output]).toEqual([step, expect.stringMatching(pattern)]);
      }
    });
  }
});
