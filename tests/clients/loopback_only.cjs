// Preloaded into the node-based agent clients the tests run (NODE_OPTIONS=--require):
// every name lookup other than loopback fails as an offline machine's would, so a client's
// own update check or telemetry (cn asks api.continue.dev for its latest version when it
// loads, whatever its settings) never leaves the machine during a test.
"use strict";
const dns = require("dns");
const LOOPBACK = new Set(["localhost", "127.0.0.1", "::1", "ip6-localhost"]);
function refused(host) {
  const err = new Error(`getaddrinfo ENOTFOUND ${host} (tests: loopback only)`);
  err.code = "ENOTFOUND";
  err.hostname = host;
  return err;
}
const lookup = dns.lookup;
dns.lookup = function (host, options, callback) {
  const cb = typeof options === "function" ? options : callback;
  if (!LOOPBACK.has(String(host).toLowerCase())) {
    process.nextTick(cb, refused(host));
    return {};
  }
  return lookup.apply(this, arguments);
};
const plookup = dns.promises.lookup;
dns.promises.lookup = function (host, ...rest) {
  if (!LOOPBACK.has(String(host).toLowerCase())) return Promise.reject(refused(host));
  return plookup.call(this, host, ...rest);
};
if (typeof globalThis.fetch === "function") {
  const realFetch = globalThis.fetch;
  globalThis.fetch = function (input, init) {
    const url = new URL(typeof input === "string" || input instanceof URL ? input : input.url);
    if (!LOOPBACK.has(url.hostname.replace(/^\[|\]$/g, "").toLowerCase())) {
      return Promise.reject(new TypeError("fetch failed", { cause: refused(url.hostname) }));
    }
    return realFetch.call(this, input, init);
  };
}
