package config

import (
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestValidateReportsEveryProblem(t *testing.T) {
	c := Default()
	c.Port = -1
	c.Policy = "nope"
	c.Retry.MaxRetries = 0
	c.CircuitBreaker.SuccessThreshold = 0
	c.HealthCheck.Endpoint = "health"
	c.CacheThreshold = 2
	c.KVEventsListen = "tcp://*:99999"
	c.HTTPServer = "caddy"
	c.MaxPayloadSize, c.MaxBufferedBodyBytes = 200<<20, 256<<20 // one body holds twice its size while it grows
	c.Workers = []Worker{{URL: "http://kv", KVEventsEndpoint: "tcp://*:5557"}, {URL: "ftp://x", Role: "prefill"}, {URL: "http://a", Runtime: "tgi"}, {URL: "http://a"}}
	err := c.Validate()
	if err == nil {
		t.Fatal("want errors")
	}
	for _, want := range []string{"port -1", `policy "nope"`, "retry.max_retries must be at least 1, got 0", "circuit_breaker.success_threshold", `health_check.endpoint "health"`, "scheme must be http", "needs pd_disaggregation", `runtime "tgi"`, "listed twice", "cache_threshold 2 is out of range 0-1", "kv events endpoint: \"tcp://*:5557\"", `kv_events_listen: "tcp://*:99999"`, `http_server "caddy"`, "below twice max_payload_size"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("errors lack %q:\n%v", want, err)
		}
	}
	for _, ok := range []string{"tcp://*:5556", "tcp://0.0.0.0:0", "tcp://[::1]:5556"} {
		if err := CheckKVEventsListen(ok); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	for _, bad := range []string{"5556", "tcp://host", "ipc:///x", "tcp://a@b:1"} {
		if CheckKVEventsListen(bad) == nil {
			t.Errorf("%s accepted", bad)
		}
	}
	if d := Default(); d.Validate() != nil {
		err := d.Validate()
		t.Errorf("defaults do not validate: %v", err)
	}
}

func TestParseFlags(t *testing.T) {
	c, err := Parse([]string{"--pd-disaggregation", "--prefill", "http://p1:8000", "9001", "--prefill", "http://p2:8000", "none",
		"--prefill", "http://p3:8000", "--decode", "http://d:8000", "--worker-urls", "http://r1", "http://r2",
		"--retry-backoff-multiplier=2", "--disable-retries", "--log-json", "--kv-connector", "NixlConnector", "--http-server", "net"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Workers) != 4 || *c.Workers[0].BootstrapPort != 9001 || c.Workers[1].BootstrapPort != nil || c.Workers[2].BootstrapPort != nil || c.Workers[3].Role != RoleDecode {
		t.Errorf("workers %+v", c.Workers)
	}
	if len(c.WorkerURLs) != 2 || c.Retry.BackoffMultiplier != 2 || !c.Retry.Disable || !c.LogJSON || c.KVConnector != "NixlConnector" || c.HTTPServer != "net" || c.PolicyFor(RolePrefill) != PolicyRoundRobin {
		t.Errorf("config %+v", c)
	}
	if _, err := Parse([]string{"--port", "x", "--nope", "--prefill"}, io.Discard); err == nil || !strings.Contains(err.Error(), "not an integer") || !strings.Contains(err.Error(), "unknown flag --nope") || !strings.Contains(err.Error(), "--prefill needs a value") {
		t.Errorf("err = %v", err)
	}
}

// The example configurations in examples/ load and validate.
func TestExamples(t *testing.T) {
	paths, _ := filepath.Glob("../../examples/*.yaml")
	if len(paths) == 0 {
		t.Fatal("no examples found")
	}
	for _, p := range paths {
		if _, err := Parse([]string{"--config", p}, io.Discard); err != nil {
			t.Errorf("%s: %v", p, err)
		}
	}
}

// Worker URLs are shown in headers, logs, metrics and GET /workers: credentials in them are
// refused with where they go instead, and no message repeats them.
func TestWorkerURLCredentialsAreRefused(t *testing.T) {
	for _, raw := range []string{"http://admin:s3cret@host:8000", "http://s3cret@host:8000", "http://admin:s3cret@host:bad port"} {
		c := Default()
		c.WorkerURLs = []string{raw}
		err := c.Validate()
		if err == nil {
			t.Errorf("%s was accepted", raw)
			continue
		}
		if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("the secret is in the error: %v", err)
		}
	}
	c := Default()
	c.WorkerURLs = []string{"http://admin:s3cret@host:8000"}
	if err := c.Validate(); !strings.Contains(err.Error(), "api_key") {
		t.Errorf("%v does not say where credentials go", err)
	}
	for _, raw := range []string{"http://host:8000/?token=x", "http://host:8000/#x"} {
		c := Default()
		c.WorkerURLs = []string{raw}
		if c.Validate() == nil {
			t.Errorf("%s was accepted", raw)
		}
	}
}

// A NIXL prefill is never paired with a Mooncake decode or the reverse: a prefill whose KV no
// decode can take is a configuration error.
func TestPrefillWithoutCompatibleDecode(t *testing.T) {
	c := Default()
	c.PDDisaggregation = true
	c.Workers = []Worker{
		{URL: "http://p1", Role: RolePrefill, KVConnector: "NixlConnector"},
		{URL: "http://p2", Role: RolePrefill, KVConnector: "mooncake"},
		{URL: "http://d1", Role: RoleDecode, KVConnector: "nixl"},
	}
	err := c.Validate()
	if err == nil || !strings.Contains(err.Error(), "http://p2") || strings.Contains(err.Error(), "http://p1") {
		t.Errorf("err = %v, want one naming the Mooncake prefill", err)
	}
	c.Workers = append(c.Workers, Worker{URL: "http://d2", Role: RoleDecode}) // names none: may take anything
	if err := c.Validate(); err != nil {
		t.Errorf("a decode naming no connector: %v", err)
	}
	c.Workers[3].Models, c.Workers[1].Models = []string{"a"}, []string{"b"}
	if err := c.Validate(); err == nil {
		t.Error("a prefill and its only possible decode share no model, yet no error")
	}
}

// YAML problems are reported all at once, each with its path and line, in plain words.
func TestYAMLErrorsHavePathsAndLines(t *testing.T) {
	path := filepath.Join(t.TempDir(), "baton.yaml")
	os.WriteFile(path, []byte(`port: 8080
polcy: random
retry:
  max_retries: lots
workers:
  - url: http://a:1
    rol: prefill
  - url: http://b:1
    dp_size: [2]
    labels: {zone: a}
`), 0o600)
	_, err := Parse([]string{"--config", path}, io.Discard)
	if err == nil {
		t.Fatal("no error")
	}
	msg := err.Error()
	for _, want := range []string{
		"polcy (line 2): unknown key (did you mean policy?)",
		"retry.max_retries (line 4): want a whole number, got \"lots\"",
		"workers[0].rol (line 7): unknown key (did you mean role?); known keys: url, role,",
		"workers[1].dp_size (line 9): want a whole number, got a list",
	} {
		if !strings.Contains(msg, want) {
			t.Errorf("error lacks %q:\n%s", want, msg)
		}
	}
	if strings.Contains(msg, "int64") || strings.Contains(msg, "config.Worker") || strings.Contains(msg, "json:") {
		t.Errorf("error names Go types: %s", msg)
	}
}

// Connector settings: vLLM's names in any case, NIXL's pull and push variants, and a
// MultiConnector read from the engine's --kv-transfer-config; what cannot hand off, or cannot be
// told, is refused with the reason.
func TestResolveKVConnector(t *testing.T) {
	multi := func(inner ...string) string {
		var cs []string
		for _, c := range inner {
			cs = append(cs, `{"kv_connector":"`+c+`","kv_role":"kv_both"}`)
		}
		return `{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":{"connectors":[` + strings.Join(cs, ",") + `]}}`
	}
	for _, tc := range []struct {
		setting, mode, variant, err string
	}{
		{"NixlConnector", ConnectorNixl, "nixl-pull", ""},
		{"nixlpullconnector", ConnectorNixl, "nixl-pull", ""},
		{"NixlPushConnector", ConnectorNixl, "nixl-push", ""},
		{"MooncakeConnector", ConnectorMooncake, ConnectorMooncake, ""},
		{"LMCacheConnectorV1", ConnectorPassthrough, ConnectorPassthrough, ""},
		{`{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`, ConnectorNixl, "nixl-pull", ""},
		{multi("NixlConnector", "OffloadingConnector"), ConnectorNixl, "nixl-pull", ""},
		{multi("OffloadingConnector", "MooncakeConnector"), ConnectorMooncake, ConnectorMooncake, ""},
		{"MultiConnector", "", "", "kv-transfer-config JSON"},
		{multi("OffloadingConnector", "LMCacheConnectorV1"), "", "", "hands off no KV"},
		{multi("NixlConnector", "MooncakeConnector"), "", "", "ambiguous"},
		{multi("Nope"), "", "", "unknown"},
		{"{not json", "", "", "not a --kv-transfer-config JSON"},
	} {
		mode, variant, err := ResolveKVConnector(tc.setting)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: err %v, want one saying %q", tc.setting, err, tc.err)
			}
			continue
		}
		if err != nil || mode != tc.mode || variant != tc.variant {
			t.Errorf("%s: %q %q %v, want %q %q", tc.setting, mode, variant, err, tc.mode, tc.variant)
		}
	}
}

// Low 14: worker URLs with ports outside 1-65535 or hosts that are no host were accepted.
func TestCheckWorkerURLBounds(t *testing.T) {
	for _, bad := range []string{"http://h:0", "http://h:65536", "http://h:99999999999", "http://a%20b:80", "http://" + strings.Repeat("a", 64) + ".x", "http://bad_host!:1"} {
		if err := CheckWorkerURL(bad); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
	for _, ok := range []string{"http://h:1", "http://h:65535", "http://10.0.0.1:8000", "http://[::1]:8000", "https://vllm-0.vllm.ns.svc.cluster.local"} {
		if err := CheckWorkerURL(ok); err != nil {
			t.Errorf("%s refused: %v", ok, err)
		}
	}
}

// Durations are durations — in flags and in YAML — and smg's integer spellings (the _secs and
// _ms flags and keys) are the same settings; a duration without its unit, a fraction in an
// integer spelling, and one setting named twice in a file are refused.
func TestDurationsAndTheirIntegerAliases(t *testing.T) {
	c, err := Parse([]string{"--request-timeout", "90s", "--stalled-client-timeout-secs", "7", "--retry-initial-backoff-ms", "20", "--load-poll-interval=250ms"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.RequestTimeout != 90*time.Second || c.StalledClientTimeout != 7*time.Second || c.Retry.InitialBackoff != 20*time.Millisecond || c.LoadPollInterval != 250*time.Millisecond {
		t.Errorf("flags: %v %v %v %v", c.RequestTimeout, c.StalledClientTimeout, c.Retry.InitialBackoff, c.LoadPollInterval)
	}
	if d := Default(); d.RequestTimeout != 30*time.Minute || d.Retry.MaxBackoff != 30*time.Second || d.PairHealth.Quarantine != 30*time.Second {
		t.Errorf("defaults: %v %v %v", d.RequestTimeout, d.Retry.MaxBackoff, d.PairHealth.Quarantine)
	}
	for _, bad := range [][]string{{"--request-timeout", "90"}, {"--request-timeout-secs", "1.5"}, {"--queue-timeout", "-1s"}, {"--load-poll-interval", "1ms"}} {
		if _, err := Parse(bad, io.Discard); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}

	path := filepath.Join(t.TempDir(), "baton.yaml")
	os.WriteFile(path, []byte("request_timeout: 2m\nbody_timeout_secs: 9\nhealth_check:\n  interval_secs: 3\n  timeout: 1500ms\npair_health:\n  quarantine_secs: 4\nretry:\n  max_backoff_ms: 700\n"), 0o600)
	c, err = Parse([]string{"--config", path, "--body-timeout", "11s"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.RequestTimeout != 2*time.Minute || c.BodyTimeout != 11*time.Second || c.HealthCheck.Interval != 3*time.Second || c.HealthCheck.Timeout != 1500*time.Millisecond ||
		c.PairHealth.Quarantine != 4*time.Second || c.Retry.MaxBackoff != 700*time.Millisecond {
		t.Errorf("YAML: %v %v %v %v %v %v", c.RequestTimeout, c.BodyTimeout, c.HealthCheck.Interval, c.HealthCheck.Timeout, c.PairHealth.Quarantine, c.Retry.MaxBackoff)
	}
	os.WriteFile(path, []byte("request_timeout: 120\nidle_timeout: soon\nbody_timeout: 5s\nbody_timeout_secs: 5\nqueue_size: 1\n"), 0o600)
	_, err = Parse([]string{"--config", path}, io.Discard)
	for _, want := range []string{
		`request_timeout (line 1): want a duration (like 30s, 500ms, 2m), got "120"`,
		`idle_timeout (line 2): want a duration`,
		`body_timeout_secs (line 4): body_timeout names the same setting again`,
		`queue_size (line 5): unknown key`,
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q: %v", want, err)
		}
	}
}

// A selector flag without --service-discovery would find nothing: refused, naming the flag.
func TestSelectorNeedsServiceDiscovery(t *testing.T) {
	_, err := Parse([]string{"--worker-urls", "http://a:1", "--selector", "app=vllm"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "add --service-discovery") {
		t.Errorf("err = %v", err)
	}
}

// Flags alone can pair a mixed fleet: each vLLM worker may name its connector after its URL
// (and the prefill's bootstrap port).
func TestWorkerConnectorsByFlag(t *testing.T) {
	c, err := Parse([]string{"--pd-disaggregation",
		"--prefill", "http://p1:1", "none", "nixl", "--decode", "http://d1:1", "NixlConnector",
		"--prefill", "http://p2:1", "8999", "mooncake", "--decode", "http://d2:1", "mooncake",
		"--prefill", "http://p3:1", "--decode", "http://d3:1"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	got := ""
	for _, w := range c.Workers {
		port := "-"
		if w.BootstrapPort != nil {
			port = strconv.Itoa(*w.BootstrapPort)
		}
		got += w.Role + ":" + port + ":" + w.KVConnector + " "
	}
	if want := "prefill:-:nixl decode:-:NixlConnector prefill:8999:mooncake decode:-:mooncake prefill:-: decode:-: "; got != want {
		t.Errorf("workers %q, want %q", got, want)
	}
}

// Keys need not sit on the command line: each is read from a file (--<flag>-file, a mounted
// Secret) or from its environment variable; the flag wins over both.
func TestKeysFromFilesAndTheEnvironment(t *testing.T) {
	dir := t.TempDir()
	key := filepath.Join(dir, "key")
	os.WriteFile(key, []byte("sk-from-file\n"), 0o600)
	t.Setenv("BATON_WORKER_API_KEY", "sk-engine-from-env")
	t.Setenv("BATON_ADMIN_API_KEY", "sk-admin-from-env")
	c, err := Parse([]string{"--client-api-key-file", key, "--admin-api-key", "sk-admin-flag", "--worker-urls", "http://a:1"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.ClientAPIKey != "sk-from-file" || c.WorkerAPIKey != "sk-engine-from-env" || c.AdminAPIKey != "sk-admin-flag" {
		t.Errorf("keys %q %q %q", c.ClientAPIKey, c.WorkerAPIKey, c.AdminAPIKey)
	}
	// The fleet's engine key goes to every worker without one of its own.
	c.Workers = []Worker{{URL: "http://b:1", APIKey: "sk-own"}}
	for _, w := range c.AllWorkers() {
		if want := map[string]string{"http://a:1": "sk-engine-from-env", "http://b:1": "sk-own"}[w.URL]; w.APIKey != want {
			t.Errorf("%s: key %q, want %q", w.URL, w.APIKey, want)
		}
	}
	two := filepath.Join(dir, "two")
	os.WriteFile(two, []byte("a\nb\n"), 0o600)
	if _, err := Parse([]string{"--client-api-key-file", two}, io.Discard); err == nil || strings.Contains(err.Error(), "a\nb") {
		t.Errorf("a file of two lines: %v", err)
	}
}

// Mistakes a new user makes are answered with the fix.
func TestErrorsNameTheFix(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--retry-max-retries", "0"}, "--disable-retries"},
		{[]string{"--worker-urls", "localhost:8000"}, "add http://"},
		{[]string{"--worker-urls", "10.0.0.1:8000"}, "add http://"},
	} {
		if _, err := Parse(c.args, io.Discard); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want %q", c.args, err, c.want)
		}
	}
}

// --model-alias is the flag form of models.<alias>.serve; adapters are checked: a name, a
// path, a base, no twice, no clash with a model name.
func TestModelAliasFlagAndAdapters(t *testing.T) {
	c, err := Parse([]string{"--worker-urls", "http://w:8000", "--model-alias", "llama=llama-3-8b-instruct", "--model-alias", "q = qwen"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.Models["llama"].Serve != "llama-3-8b-instruct" || c.Models["q"].Serve != "qwen" {
		t.Fatalf("models %+v", c.Models)
	}
	for _, bad := range []string{"llama", "=x", "x=", "x=x"} {
		if _, err := Parse([]string{"--worker-urls", "http://w:8000", "--model-alias", bad}, io.Discard); err == nil || !strings.Contains(err.Error(), "ALIAS=MODEL") {
			t.Errorf("--model-alias %q: %v", bad, err)
		}
	}
	dir := t.TempDir()
	p := filepath.Join(dir, "c.yaml")
	os.WriteFile(p, []byte(`worker_urls: [http://w:8000]
models: {sql: {serve: x}}
adapters:
  - {name: a, path: /a, base: m}
  - {name: a, path: /a, base: m}
  - {name: "b:c", path: /b, base: m}
  - {name: d, base: m}
  - {name: e, path: /e}
  - {name: sql, path: /s, base: m}
`), 0o600)
	_, err = Parse([]string{"--config", p}, io.Discard)
	for _, want := range []string{"adapter \"a\" is declared twice", "\"b:c\" is no adapter name", "(d): give the path", "(e): give its base model", "\"sql\" is also a name of models:"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("want %q in %v", want, err)
		}
	}
}

// A file given as the configuration that is not one (a key file, say) is refused without its
// content; a value under a key named like a credential is never echoed either.
func TestConfigErrorsEchoNoSecret(t *testing.T) {
	dir := t.TempDir()
	for _, body := range []string{"sk-supersecret-123\n", "client_api_key: {sk-supersecret-123: 1}\nredis_url_x: 1\n", "rate_limit_store: [sk-supersecret-123]\n"} {
		p := filepath.Join(dir, "c.yaml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := Parse([]string{"--config", p}, io.Discard)
		if err == nil || strings.Contains(err.Error(), "supersecret") {
			t.Errorf("%q: %v", body, err)
		}
	}
}
