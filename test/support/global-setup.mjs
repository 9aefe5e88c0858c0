// Runs once before the suite: stops at once when redis-server is missing, and compiles the library
// and the child-process fixtures into .test-build/ (child processes run plain Node, not Jest).
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { compile, root } from '../../scripts/compile-ts.mjs';

export default function globalSetup() {
  if (spawnSync('redis-server', ['--version'], { stdio: 'ignore' }).status !== 0) {
    throw new Error(
      'redis-server is not installed, and every lock test runs against a real Redis.\n' +
        'Install it, then run the tests again:\n' +
        '  Debian/Ubuntu: sudo apt-get install -y redis-server\n' +
        '  macOS:         brew install redis',
    );
  }
  compile(join(root, '.test-build'), ['lib', 'test/fixtures', 'test/support']);
}
