/**
 * `text` with the secrets of the Redis URLs in it replaced by `***`: the password of a URL's user
 * information (`redis://user:***@host`, or `redis://***@host` when it has no colon, since some
 * write the password alone there; up to the last `@`, so that a password that cuts the URL short
 * with a `#` or `/` is hidden too), and ioredis's `password` and `sentinelPassword` query options.
 * Error messages and log lines that echo a connection string go through it, so a secret read from
 * the environment does not end up in the logs. Internal.
 */
export function redactUrls(text: string): string {
  return text
    .replace(/\/\/([^\s"]*)@/g, (_match, userinfo: string) => {
      const colon = userinfo.indexOf(':');
      return colon === -1 ? '//***@' : `//${userinfo.slice(0, colon)}:***@`;
    })
    .replace(/([?&](?:sentinelP|p)assword=)[^&#\s"]*/gi, '$1***');
}
