package cli

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/epp/dataplane"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// runUntil runs Run with args in the background until the output matches re, and returns the
// first submatch; the command is stopped at cleanup and must return nil.
func runUntil(t *testing.T, re *regexp.Regexp, args ...string) string {
	t.Helper()
	return re.FindStringSubmatch(runOut(t, re, args...))[1]
}

// runOut runs args until their output matches re, and returns the output so far.
func runOut(t *testing.T, re *regexp.Regexp, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &gwtest.SyncBuffer{}
	res := make(chan error, 1)
	go func() { res <- Run(ctx, args, out, io.Discard) }()
	t.Cleanup(func() {
		cancel()
		if err := <-res; err != nil {
			t.Errorf("Run(%v) = %v after stop", args, err)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if o := out.String(); re.MatchString(o) {
			return o
		}
		if time.Now().After(deadline) {
			t.Fatalf("no match for %s in %q", re, out.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestSimCommand(t *testing.T) {
	t.Parallel()
	url := runUntil(t, regexp.MustCompile(`serving on (http://\S+)`), "sim", "--engine", "sglang", "--role", "prefill", "--port", "0", "--model", "x")
	resp, err := http.Get(url + "/get_server_info")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `"disaggregation_mode":"prefill"`) {
		t.Errorf("server info %s", body)
	}
	if err := Run(context.Background(), []string{"sim", "--engine", "tgi"}, io.Discard, io.Discard); err == nil {
		t.Error("sim --engine tgi: want error")
	}
}

func TestDemoCommand(t *testing.T) {
	t.Parallel()
	api := runUntil(t, regexp.MustCompile(`baton serving on (http://\S+)`), "demo", "--port", "0", "--metrics-port", "0")
	for _, model := range []string{"demo-nixl", "demo-mooncake", "demo-sglang"} {
		var status int
		var body, source string
		poll.Until(t, "the condition", func() bool { // each pair registers on its own
			resp, err := http.Post(api+"/v1/chat/completions", "application/json",
				strings.NewReader(`{"model":"`+model+`","messages":[{"role":"user","content":"hello baton"}],"max_tokens":4}`))
			if err != nil {
				return false
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			status, body, source = resp.StatusCode, string(b), resp.Header.Get("X-Sim-KV-Source")
			return status != 503
		})
		if status != 200 || !strings.Contains(body, `"completion_tokens":4`) || source != "remote" {
			t.Errorf("demo chat on %s: %d %s (kv source %q)", model, status, body, source)
		}
	}
}

// baton epp serves the Endpoint Picker's gRPC services beside its HTTP listener: over TLS by
// default (a certificate made at startup, as the reference picker's), with the health services
// on a plaintext port of their own for the kubelet; ready once its worker registered, and
// picking it over ext_proc. A plaintext client is refused on the TLS port.
func TestEPPCommand(t *testing.T) {
	t.Parallel()
	engine := runUntil(t, regexp.MustCompile(`serving on (http://\S+)`), "sim", "--engine", "vllm", "--port", "0", "--model", "m")
	out := runOut(t, regexp.MustCompile(`endpoint picker health \(gRPC, plaintext\) on (\S+)`), "epp", "--host", "127.0.0.1", "--port", "0",
		"--metrics-port", "-1", "--grpc-port", "0", "--grpc-health-port", "0", "--worker-urls", engine)
	addr := regexp.MustCompile(`endpoint picker \(ext_proc, gRPC health\) on (\S+)`).FindStringSubmatch(out)[1]
	healthAddr := regexp.MustCompile(`endpoint picker health \(gRPC, plaintext\) on (\S+)`).FindStringSubmatch(out)[1]
	plain, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	if _, err := healthpb.NewHealthClient(plain).Check(ctx, &healthpb.HealthCheckRequest{Service: "liveness"}); err == nil {
		t.Error("a plaintext client was served on the TLS port")
	}
	hconn, err := grpc.NewClient(healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer hconn.Close()
	poll.Until(t, "the health port says ready", func() bool {
		r, err := healthpb.NewHealthClient(hconn).Check(t.Context(), &healthpb.HealthCheckRequest{Service: "readiness"})
		return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	poll.Until(t, "the picker is ready", func() bool {
		r, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "readiness"})
		return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})
	front := httptest.NewServer(&dataplane.Proxy{Picker: extprocv3.NewExternalProcessorClient(conn), Client: &http.Client{}})
	defer front.Close()
	resp, err := http.Post(front.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"completion_tokens":2`) {
		t.Errorf("through the picker: %d %s", resp.StatusCode, body)
	}
}

// On shutdown the picker drains: readiness stops serving at once, an exchange still answering
// finishes, and then baton epp returns.
func TestEPPDrains(t *testing.T) {
	t.Parallel()
	engine := runUntil(t, regexp.MustCompile(`serving on (http://\S+)`), "sim", "--engine", "vllm", "--port", "0", "--model", "m")
	ctx, cancel := context.WithCancel(context.Background())
	out := &gwtest.SyncBuffer{}
	res := make(chan error, 1)
	go func() {
		res <- Run(ctx, []string{"epp", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--grpc-port", "0", "--grpc-health-port", "-1",
			"--epp-secure-serving=false", "--worker-urls", engine}, out, io.Discard)
	}()
	defer cancel()
	var addr string
	poll.Until(t, "the picker listens", func() bool {
		m := regexp.MustCompile(`endpoint picker \(ext_proc, gRPC health\) on (\S+)`).FindStringSubmatch(out.String())
		if m != nil {
			addr = m[1]
		}
		return m != nil
	})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	serving := func() bool {
		r, err := hc.Check(t.Context(), &healthpb.HealthCheckRequest{Service: "readiness"})
		return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}
	poll.Until(t, "ready", serving)
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
	st.Send(dataplane.RequestBody([]byte(`{"model":"m","prompt":"x"}`), true))
	for i := 0; i < 2; i++ { // the pick, the body handed back
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	cancel() // SIGTERM
	poll.Until(t, "not ready while draining", func() bool { return !serving() })
	select {
	case err := <-res:
		t.Fatalf("baton epp returned (%v) with an exchange still answering", err)
	case <-time.After(300 * time.Millisecond):
	}
	st.Send(dataplane.ResponseHeaders(http.StatusOK, nil, "", true))
	if _, err := st.Recv(); err != nil {
		t.Fatalf("the exchange was cut by the drain: %v", err)
	}
	st.CloseSend()
	select {
	case err := <-res:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("baton epp did not return after its last exchange")
	}
}

// The developer commands' help exits 0 (as config.ErrHelp) and lists --long-names; there is a
// version; a bench scenario that does not exist is an error naming the valid ones.
func TestHelpVersionAndBenchScenarios(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"sim", "--help"}, {"demo", "--help"}, {"bench", "--help"}, {"--help"}, {"serve", "--help"}, {"epp", "--help"}} {
		var out bytes.Buffer
		if err := Run(t.Context(), args, &out, io.Discard); err != config.ErrHelp || !strings.Contains(out.String(), "  --") {
			t.Errorf("%v: %v, printed %q; want config.ErrHelp and the --flags", args, err, out.String())
		}
	}
	for _, args := range [][]string{{"version"}, {"--version"}} {
		var out bytes.Buffer
		if err := Run(t.Context(), args, &out, io.Discard); err != nil || !strings.HasPrefix(out.String(), "baton ") {
			t.Errorf("%v: %v %q", args, err, out.String())
		}
	}
	if err := Run(t.Context(), []string{"bench", "--scenarios", "latency,bogus"}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), `"bogus"`) {
		t.Errorf("bench with an unknown scenario: %v", err)
	}
	if err := Run(t.Context(), []string{"frobnicate"}, io.Discard, io.Discard); err == nil {
		t.Error("an unknown command ran")
	}
}

// `baton check` sends every pair that can meet one request and fails when a pair would
// recompute instead of handing off its KV.
func TestCheckReportsEveryPair(t *testing.T) {
	t.Parallel()
	start := func(c sim.Config) *sim.Engine { return simEngine(t, c) }
	np := start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	nd := start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	sp := start(sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill})
	sd := start(sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode})
	good := []string{"check", "--pd-disaggregation", "--disable-health-check",
		"--prefill", np.URL(), "--decode", nd.URL(), "--kv-connector", "nixl",
		"--prefill", sp.URL(), strconv.Itoa(sp.BootstrapPort()), "--decode", sd.URL()}
	var out bytes.Buffer
	if err := Run(t.Context(), good, &out, io.Discard); err != nil || !strings.Contains(out.String(), "nixl") || !strings.Contains(out.String(), "bootstrap") {
		t.Fatalf("a fleet that hands off: %v\n%s", err, out.String())
	}
	mp := start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorMooncake})
	md := start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorMooncake})
	// A mixed vLLM fleet given by flags alone: each worker names its connector, NIXL pairs
	// with NIXL and Mooncake with Mooncake (the engine id learned from the bootstrap server).
	out.Reset()
	mixed := []string{"check", "--pd-disaggregation", "--disable-health-check",
		"--prefill", np.URL(), "none", "nixl", "--decode", nd.URL(), "nixl",
		"--prefill", mp.URL(), strconv.Itoa(mp.BootstrapPort()), "mooncake", "--decode", md.URL(), "mooncake"}
	if err := Run(t.Context(), mixed, &out, io.Discard); err != nil || !strings.Contains(out.String(), " nixl") || !strings.Contains(out.String(), " mooncake") {
		t.Errorf("a mixed fleet by flags: %v\n%s", err, out.String())
	}
	out.Reset()
	err := Run(t.Context(), []string{"check", "--pd-disaggregation", "--disable-health-check",
		"--prefill", mp.URL(), "1", "--decode", md.URL(), "--kv-connector", "MooncakeConnector"}, &out, io.Discard)
	if err == nil || !strings.Contains(out.String(), "none-no-engine-id") {
		t.Errorf("a Mooncake prefill whose engine id cannot be had: %v\n%s", err, out.String())
	}
	// Params relayed to a decode that computes the prompt anyway (its connector reads none of
	// them), and to one whose usage cannot say: neither is a green light.
	for _, tc := range []struct {
		decode sim.Config
		want   string
	}{
		{sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorMooncake}, "recomputed"},
		{sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl, NoPromptTokensDetails: true}, "unverified"},
	} {
		d := start(tc.decode)
		out.Reset()
		err := Run(t.Context(), []string{"check", "--pd-disaggregation", "--disable-health-check",
			"--prefill", np.URL(), "--decode", d.URL(), "--kv-connector", "nixl"}, &out, io.Discard)
		if err == nil || !strings.Contains(out.String(), tc.want) {
			t.Errorf("want %s: %v\n%s", tc.want, err, out.String())
		}
	}
}

// `baton check` never passes having checked nothing: a fleet without a decode, a vLLM prefill
// facing an SGLang decode, and a decode that is down each fail with the reason per worker;
// regular workers are checked by one request each; --json is one object a pipeline can read.
func TestCheckFailsOnBrokenFleets(t *testing.T) {
	t.Parallel()
	start := func(c sim.Config) *sim.Engine { return simEngine(t, c) }
	np := start(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	sd := start(sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode})
	gone := gwtest.RefusingURL(t) // a decode that is down
	base := []string{"check", "--wait", "2s", "--pd-disaggregation", "--disable-health-check", "--kv-connector", "nixl", "--prefill", np.URL()}
	for _, c := range []struct {
		name string
		args []string
		want []string
	}{
		{"no decode", nil, []string{"has no decode worker"}}, // refused with the configuration already
		{"vLLM prefill, SGLang decode", []string{"--decode", sd.URL()}, []string{"nothing could be checked", "no registered prefill it can hand KV to or from"}},
		{"decode down", []string{"--decode", gone}, []string{"nothing could be checked", "refused", "connection refused"}},
	} {
		var out bytes.Buffer
		err := Run(t.Context(), append(slices.Clone(base), c.args...), &out, io.Discard)
		if err == nil {
			t.Errorf("%s: check passed:\n%s", c.name, out.String())
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(out.String()+err.Error(), w) {
				t.Errorf("%s: the report lacks %q:\n%s\n%v", c.name, w, out.String(), err)
			}
		}
	}

	// Regular workers, one answering and one down; then the answering one alone, as JSON.
	ok := start(sim.Config{Engine: sim.EngineVLLM})
	var out bytes.Buffer
	err := Run(t.Context(), []string{"check", "--wait", "2s", "--disable-health-check", "--worker-urls", ok.URL(), gone}, &out, io.Discard)
	if err == nil || !strings.Contains(out.String(), "took part in no passing check") {
		t.Errorf("a regular fleet with a worker down: %v\n%s", err, out.String())
	}
	out.Reset()
	if err := Run(t.Context(), []string{"check", "--json", "--wait", "2s", "--disable-health-check", "--worker-urls", ok.URL()}, &out, io.Discard); err != nil {
		t.Fatalf("a healthy regular fleet: %v\n%s", err, out.String())
	}
	var rep struct {
		OK      bool
		Workers []struct {
			URL    string
			Status int
			OK     bool
		}
	}
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil || !rep.OK || len(rep.Workers) != 1 || rep.Workers[0].Status != 200 || !rep.Workers[0].OK {
		t.Errorf("--json: %v %+v\n%s", err, rep, out.String())
	}
}

// baton check says what it knows of each worker, in the table and in --json alike: the engine
// wants another key, the connection was refused, the host is no engine, its configuration names
// a model its engine does not serve, it did not answer within the request timeout — and a model
// the configuration names that no engine serves fails the check.
func TestCheckSaysWhy(t *testing.T) {
	t.Parallel()
	keyed := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(401) }))
	t.Cleanup(keyed.Close)
	// An engine that lists its models to anyone but wants a key to generate.
	listsOnly := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}`)
			return
		}
		w.WriteHeader(401)
	}))
	t.Cleanup(listsOnly.Close)
	notEngine := httptest.NewServer(http.HandlerFunc(http.NotFound))
	t.Cleanup(notEngine.Close)
	gone := gwtest.RefusingURL(t)
	ok := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	hang := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{Hang: true}})
	dir := t.TempDir()
	file := filepath.Join(dir, "baton.yaml")
	yaml := fmt.Sprintf("request_timeout: 1s\nworkers:\n  - {url: %s}\n  - {url: %s}\n  - {url: %s}\n  - {url: %s, models: [m, ghost]}\n  - {url: %s}\n  - {url: %s}\nmodels:\n  chat: {serve: nowhere}\n",
		keyed.URL, notEngine.URL, gone, ok.URL(), hang.URL(), listsOnly.URL)
	if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	var table, js bytes.Buffer
	if err := Run(t.Context(), []string{"check", "--wait", "2s", "--disable-health-check", "--config", file}, &table, io.Discard); err == nil {
		t.Fatalf("check passed:\n%s", table.String())
	}
	if err := Run(t.Context(), []string{"check", "--json", "--wait", "2s", "--disable-health-check", "--config", file}, &js, io.Discard); err == nil {
		t.Fatalf("check --json passed:\n%s", js.String())
	}
	var rep struct {
		Workers []struct {
			URL, Cause, Reason string
		}
		Unservable []string
	}
	if err := json.Unmarshal(js.Bytes(), &rep); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{keyed.URL: "wrong_key", notEngine.URL: "not_an_engine", gone: "refused", ok.URL(): "model_missing", hang.URL(): "timeout", listsOnly.URL: "wrong_key"}
	for _, w := range rep.Workers {
		if w.Cause != want[w.URL] || w.Reason == "" {
			t.Errorf("%s: cause %q (%s), want %s", w.URL, w.Cause, w.Reason, want[w.URL])
		}
		if !strings.Contains(table.String(), want[w.URL]) {
			t.Errorf("the table lacks %s's cause %s:\n%s", w.URL, want[w.URL], table.String())
		}
	}
	if u := strings.Join(rep.Unservable, "; "); !strings.Contains(u, `"ghost"`) || !strings.Contains(u, `"nowhere"`) || !strings.Contains(table.String(), "nowhere") {
		t.Errorf("unservable %q; table:\n%s", u, table.String())
	}
}

// simEngine starts a simulated engine serving model "m", closed with the test.
func simEngine(t *testing.T, c sim.Config) *sim.Engine {
	t.Helper()
	c.Model = "m"
	e, err := sim.Start(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}

// baton hash-key prints the configuration's form of the key on standard input, one line only.
func TestHashKey(t *testing.T) {
	var out strings.Builder
	Stdin = strings.NewReader("sk-team-a\n")
	defer func() { Stdin = os.Stdin }()
	if err := Run(t.Context(), []string{"hash-key"}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(out.String()); got != config.HashKey("sk-team-a") || !strings.HasPrefix(got, "sha256:") || len(got) != 7+64 {
		t.Errorf("hash-key printed %q", got)
	}
	for _, in := range []string{"", "\n", "two\nlines\n"} {
		Stdin = strings.NewReader(in)
		if err := Run(t.Context(), []string{"hash-key"}, io.Discard, io.Discard); err == nil {
			t.Errorf("hash-key of %q accepted", in)
		}
	}
}

// smg's ways of naming the router and asking its version work: `launch` (and `start`) run the
// gateway as serve does; --version, --version-verbose and -V print the version.
func TestSmgCommandNames(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"-V"}, {"--version-verbose"}} {
		var out bytes.Buffer
		if err := Run(t.Context(), args, &out, io.Discard); err != nil || !strings.Contains(out.String(), "baton") {
			t.Errorf("%v: %v %q", args, err, out.String())
		}
	}
	for _, cmd := range []string{"launch", "start"} {
		err := Run(t.Context(), []string{cmd, "--help"}, io.Discard, io.Discard)
		if !errors.Is(err, config.ErrHelp) {
			t.Errorf("%s --help: %v, want the serve command's help", cmd, err)
		}
	}
}

// The conformance kit passes every case against Baton's own picker, over TLS (its default) with
// the health services on their own port; and it fails a picker that breaks the protocol.
func TestEPPConformanceKit(t *testing.T) {
	t.Parallel()
	engine := runUntil(t, regexp.MustCompile(`serving on (http://\S+)`), "sim", "--engine", "vllm", "--port", "0", "--model", "m")
	engine2 := runUntil(t, regexp.MustCompile(`serving on (http://\S+)`), "sim", "--engine", "vllm", "--port", "0", "--model", "m")
	out := runOut(t, regexp.MustCompile(`endpoint picker health \(gRPC, plaintext\) on (\S+)`), "epp", "--host", "127.0.0.1", "--port", "0",
		"--metrics-port", "-1", "--grpc-port", "0", "--grpc-health-port", "0", "--max-payload-size", "16777216", "--worker-urls", engine, engine2)
	addr := regexp.MustCompile(`endpoint picker \(ext_proc, gRPC health\) on (\S+)`).FindStringSubmatch(out)[1]
	health := regexp.MustCompile(`endpoint picker health \(gRPC, plaintext\) on (\S+)`).FindStringSubmatch(out)[1]
	hconn, _ := grpc.NewClient(health, grpc.WithTransportCredentials(insecure.NewCredentials()))
	defer hconn.Close()
	poll.Until(t, "the picker ready", func() bool {
		r, err := healthpb.NewHealthClient(hconn).Check(t.Context(), &healthpb.HealthCheckRequest{Service: "readiness"})
		return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})
	var js bytes.Buffer
	err := Run(t.Context(), []string{"epp-conformance", "--target", addr, "--health", health, "--tls", "--model", "m", "--json"}, &js, io.Discard)
	var results []struct {
		Name, Detail string
		Pass         bool
	}
	if jerr := json.Unmarshal(js.Bytes(), &results); jerr != nil {
		t.Fatalf("%v: %s", jerr, js.String())
	}
	if len(results) < 30 {
		t.Errorf("%d cases: want at least 30", len(results))
	}
	for _, r := range results {
		if !r.Pass {
			t.Errorf("%s: %s", r.Name, r.Detail)
		}
	}
	if err != nil {
		t.Errorf("the kit against Baton's picker: %v", err)
	}
	// The load mode measures picks.
	var load bytes.Buffer
	if err := Run(t.Context(), []string{"epp-conformance", "--target", addr, "--tls", "--model", "m", "--load", "100", "--duration", "1s"}, &load, io.Discard); err != nil || !strings.Contains(load.String(), "picked") {
		t.Errorf("load: %v %s", err, load.String())
	}
	// A picker that answers every request headers at once with no pick fails the pick cases.
	bad := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(bad, brokenPicker{})
	ln, lerr := net.Listen("tcp", "127.0.0.1:0")
	if lerr != nil {
		t.Fatal(lerr)
	}
	go bad.Serve(ln)
	defer bad.Stop()
	var badOut bytes.Buffer
	if err := Run(t.Context(), []string{"epp-conformance", "--target", ln.Addr().String(), "--model", "m", "--timeout", "1s"}, &badOut, io.Discard); err == nil || !strings.Contains(badOut.String(), "pick/header") {
		t.Errorf("a broken picker passed: %v\n%s", err, badOut.String())
	}
}

// brokenPicker answers each message with an empty headers response: no pick, ever.
type brokenPicker struct {
	extprocv3.UnimplementedExternalProcessorServer
}

func (brokenPicker) Process(st extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		if _, err := st.Recv(); err != nil {
			return nil
		}
		if err := st.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}); err != nil {
			return nil
		}
	}
}
