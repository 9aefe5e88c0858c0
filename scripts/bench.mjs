// `npm run bench`: compiles lib, bench and the test harness with swc, then runs bench/run.ts.
// `npm run bench:profile`, `npm run bench:instructions` and `npm run bench:report` (arguments
// `profile`, `instructions`, `report`) run bench/profile.ts, bench/redis-instructions.ts and
// bench/write-report.ts instead.
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { compile, root } from './compile-ts.mjs';

const out = join(root, '.bench-build');
compile(out, ['lib', 'bench', 'test/support']);
const result = spawnSync(process.execPath, ['--expose-gc', join(out, 'bench', { profile: 'profile.js', instructions: 'redis-instructions.js', report: 'write-report.js' }[process.argv[2]] ?? 'run.js')], { cwd: root, stdio: 'inherit' });
process.exit(result.status ?? 1);
