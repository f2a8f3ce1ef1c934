package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
)

func engine(t *testing.T, routes map[string]string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, ok := routes[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestDetect(t *testing.T) {
	models := func(owner string) string {
		return `{"object":"list","data":[{"id":"m1","object":"model","owned_by":"` + owner + `"},{"id":"m2","owned_by":"` + owner + `"}]}`
	}
	tests := []struct {
		name        string
		routes      map[string]string
		cfg         config.Worker
		wantRuntime string
		wantModels  []string
	}{
		{"vllm by owned_by", map[string]string{"/v1/models": models("vllm")}, config.Worker{}, "vllm", []string{"m1", "m2"}},
		{"sglang by owned_by", map[string]string{"/v1/models": models("sglang")}, config.Worker{}, "sglang", []string{"m1", "m2"}},
		{"vllm by /version", map[string]string{"/v1/models": models("someone"), "/version": `{"version":"0.11"}`}, config.Worker{}, "vllm", []string{"m1", "m2"}},
		{"sglang by /server_info", map[string]string{"/v1/models": models("x"), "/server_info": `{}`}, config.Worker{}, "sglang", []string{"m1", "m2"}},
		{"sglang by /get_server_info", map[string]string{"/get_server_info": `{"model_path":"/models/llama"}`}, config.Worker{}, "sglang", nil},
		{"generic", map[string]string{"/v1/models": models("openai")}, config.Worker{}, "generic", []string{"m1", "m2"}},
		{"configured wins", map[string]string{"/v1/models": models("vllm")}, config.Worker{Runtime: "sglang", Models: []string{"only"}}, "sglang", []string{"only"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := engine(t, tc.routes)
			tc.cfg.URL = srv.URL
			in, err := Detect(context.Background(), srv.Client(), New(tc.cfg))
			if err != nil {
				t.Fatal(err)
			}
			var ids []string
			for _, m := range in.Models {
				ids = append(ids, m.ID)
			}
			if in.Runtime != tc.wantRuntime || len(ids) != len(tc.wantModels) {
				t.Fatalf("got %s %v, want %s %v", in.Runtime, ids, tc.wantRuntime, tc.wantModels)
			}
			for i := range ids {
				if ids[i] != tc.wantModels[i] {
					t.Fatalf("models %v, want %v", ids, tc.wantModels)
				}
			}
		})
	}
}

func TestDetectUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	if _, err := Detect(context.Background(), http.DefaultClient, New(config.Worker{URL: "http://" + addr})); err == nil {
		t.Fatal("want error for a closed port")
	}
}

// An engine that is down at startup (it drops every connection, as while it loads) is
// registered later, on its own, and only then becomes ready.
func TestRegistrarRetriesUntilReachable(t *testing.T) {
	var up atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !up.Load() {
			c, _, _ := w.(http.Hijacker).Hijack()
			c.Close()
			return
		}
		io.WriteString(w, `{"data":[{"id":"m1","owned_by":"vllm"}]}`)
	}))
	defer srv.Close()

	w := New(config.Worker{URL: srv.URL})
	reg := NewRegistry(w)
	r := &Registrar{Registry: reg, Client: srv.Client(), Log: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxInterval: 50 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); r.Wait() }()
	r.Start(ctx)
	time.Sleep(100 * time.Millisecond)
	if w.Ready() || w.Registered() {
		t.Fatal("worker ready before its engine started")
	}
	if c, pending := reg.Snapshot().Candidates(config.RoleRegular, ""); len(c) != 0 || !pending {
		t.Fatalf("candidates %v pending %v before registration, want none and pending", c, pending)
	}
	if _, pending := reg.Snapshot().Candidates(config.RoleRegular, "m1"); !pending {
		t.Fatal("before any worker registered, any model may be a registering worker's")
	}
	up.Store(true)
	deadline := time.Now().Add(10 * time.Second)
	for !w.Ready() {
		if time.Now().After(deadline) {
			t.Fatal("worker never became ready")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if c, _ := reg.Snapshot().Candidates(config.RoleRegular, "m1"); len(c) != 1 || w.Runtime() != "vllm" {
		t.Fatalf("after registration: candidates %v runtime %q", c, w.Runtime())
	}
}

func TestEnterLeaveCountInFlight(t *testing.T) {
	w := New(config.Worker{URL: "http://x"})
	a, b := w.Enter(), w.Enter()
	if w.InFlight() != 2 || a || b {
		t.Fatalf("in flight %d (probes %v %v), want 2 and no probes without a breaker", w.InFlight(), a, b)
	}
	w.Leave(a)
	w.Leave(b)
	if w.InFlight() != 0 {
		t.Fatalf("in flight %d after both left, want 0", w.InFlight())
	}
}

// DP ranks: the rank with the fewest legs in flight is chosen, ties in turn.
func TestNextRankPrefersTheIdleRank(t *testing.T) {
	w := New(config.Worker{URL: "http://dp", DPSize: 3})
	seen := map[int]bool{}
	for i := 0; i < 3; i++ {
		r, ok := w.NextRank()
		if !ok {
			t.Fatal("a worker with dp_size 3 has no rank")
		}
		seen[r] = true
	}
	if len(seen) != 3 {
		t.Fatalf("idle ranks used %v, want all three in turn", seen)
	}
	w.EnterRank(0)
	w.EnterRank(0)
	w.EnterRank(2)
	for i := 0; i < 6; i++ {
		if r, _ := w.NextRank(); r != 1 {
			t.Fatalf("chose rank %d with %v in flight", r, w.RankInFlight(3))
		}
	}
	w.LeaveRank(0)
	w.LeaveRank(0)
	w.LeaveRank(2)
	if got := w.RankInFlight(3); got[0] != 0 || got[1] != 0 || got[2] != 0 {
		t.Fatalf("in flight per rank %v after every leg left", got)
	}
	if _, ok := New(config.Worker{URL: "http://x"}).NextRank(); ok {
		t.Error("a worker without DP ranks returned a rank")
	}
}

// What OnRegistered learns about a worker (a Mooncake prefill's engine ids) is known before the
// worker takes traffic: a request routed in between would lose its KV handoff.
func TestRegisteredHookRunsBeforeReady(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"data":[{"id":"m1","owned_by":"vllm"}]}`)
	}))
	defer srv.Close()
	w := New(config.Worker{URL: srv.URL})
	var readyDuring, runtimeDuring atomic.Value
	r := &Registrar{Registry: NewRegistry(w), Client: srv.Client(), Log: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxInterval: 50 * time.Millisecond,
		OnRegistered: func(w *Worker) {
			time.Sleep(50 * time.Millisecond) // a slow bootstrap server
			readyDuring.Store(w.Ready())
			runtimeDuring.Store(w.Runtime())
		}}
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); r.Wait() }()
	r.Start(ctx)
	deadline := time.Now().Add(10 * time.Second)
	for !w.Ready() {
		if time.Now().After(deadline) {
			t.Fatal("worker never became ready")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if readyDuring.Load() != false || runtimeDuring.Load() != "vllm" {
		t.Fatalf("during OnRegistered: ready %v, runtime %v; want not ready yet, runtime known", readyDuring.Load(), runtimeDuring.Load())
	}
}

// An SGLang engine's /server_info kv_events descriptor becomes the worker's KV events
// publisher: a bind-all host is the worker's own; a port or DP size out of range, or a publisher
// that is not ZMQ, is none.
func TestDetectSGLangKVEvents(t *testing.T) {
	models := `{"object":"list","data":[{"id":"m","owned_by":"sglang"}]}`
	for _, c := range []struct{ info, want string }{
		{`{"dp_size":2,"kv_events":{"publisher":"zmq","endpoint_host":"*","endpoint_port_base":5557,"topic":"kv","block_size":64,"dp_size":2}}`, "tcp://127.0.0.1:5557 64 2 kv"},
		{`{"kv_events":{"publisher":"zmq","endpoint_host":"10.1.2.3","endpoint_port_base":6000,"block_size":1}}`, "tcp://10.1.2.3:6000 1 0 "},
		{`{"kv_events":{"publisher":"zmq","endpoint_host":"*","endpoint_port_base":70000}}`, ""},
		{`{"kv_events":{"publisher":"zmq","endpoint_host":"*","endpoint_port_base":5557,"dp_size":100000}}`, ""},
		{`{"kv_events":{"publisher":"null"}}`, ""},
		{`{"dp_size":1}`, ""},
	} {
		srv := engine(t, map[string]string{"/v1/models": models, "/server_info": c.info})
		in, err := Detect(context.Background(), srv.Client(), New(config.Worker{URL: srv.URL}))
		if err != nil {
			t.Fatal(err)
		}
		got := ""
		if p := in.KVEvents; p != nil {
			got = fmt.Sprintf("%s %d %d %s", p.Endpoint, p.BlockSize, p.DPSize, p.Topic)
		}
		if got != c.want {
			t.Errorf("%s: %q, want %q", c.info, got, c.want)
		}
	}
}

// An engine that wants a key is not registered on a guess: its 401 names the fix — the engine
// key, which is not Baton's client key (smg sends that one on; Baton never does).
func TestDetectNamesTheEngineKey(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer sk-engine" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		io.WriteString(w, `{"data":[{"id":"m","owned_by":"vllm"}]}`)
	}))
	defer srv.Close()
	_, err := Detect(context.Background(), srv.Client(), New(config.Worker{URL: srv.URL}))
	if !errors.Is(err, ErrNeedsKey) || !strings.Contains(err.Error(), "--worker-api-key") {
		t.Errorf("without a key: %v", err)
	}
	in, err := Detect(context.Background(), srv.Client(), New(config.Worker{URL: srv.URL, APIKey: "sk-engine"}))
	if err != nil || in.Runtime != config.RuntimeVLLM {
		t.Errorf("with the key: %+v %v", in, err)
	}
}

// A host is a worker only when it answers as an engine does: a /v1/models with a model, or an
// engine info route naming one. A server answering 404 (or an empty 200) to every path is not
// one, whatever its configuration says; a configured model its engine does not list is
// unserved.
func TestDetectRefusesWhatIsNoEngine(t *testing.T) {
	for name, routes := range map[string]map[string]string{
		"404 everywhere":      {},
		"200 to everything":   {"/v1/models": `ok`, "/server_info": `ok`, "/get_model_info": `{}`},
		"an empty model list": {"/v1/models": `{"object":"list","data":[]}`},
	} {
		t.Run(name, func(t *testing.T) {
			srv := engine(t, routes)
			_, err := Detect(context.Background(), srv.Client(), New(config.Worker{URL: srv.URL, Models: []string{"m"}}))
			if !errors.Is(err, ErrNotEngine) {
				t.Errorf("got %v, want ErrNotEngine", err)
			}
		})
	}
	srv := engine(t, map[string]string{"/v1/models": `{"data":[{"id":"llama","owned_by":"vllm"}]}`})
	in, err := Detect(context.Background(), srv.Client(), New(config.Worker{URL: srv.URL, Models: []string{"llama", "ghost"}}))
	if err != nil || !slices.Equal(in.Unserved, []string{"ghost"}) {
		t.Fatalf("unserved %v, %v; want [ghost]", in.Unserved, err)
	}
	w := New(config.Worker{URL: srv.URL, Models: []string{"llama", "ghost"}})
	w.SetInfo(in)
	snap := NewRegistry(w).Snapshot()
	if c, _ := snap.Candidates(config.RoleRegular, "ghost"); len(c) != 0 {
		t.Error("a worker is a candidate for a model its engine does not serve")
	}
	if c, _ := snap.Candidates(config.RoleRegular, "llama"); len(c) != 1 {
		t.Error("the worker is no candidate for the model its engine serves")
	}
	if got := snap.Unserved(); !slices.Equal(got, []string{"ghost"}) {
		t.Errorf("Unserved() = %v", got)
	}
}

// A model no worker names: while a worker's first registration has not answered it may be that
// worker's (503, retried); once that worker failed to register — an engine that is down — it is
// unknown (404), however long the engine keeps being retried.
func TestAnUnknownModelOnceWorkersAnswered(t *testing.T) {
	up := New(config.Worker{URL: "http://127.0.0.1:1"})
	up.SetInfo(&Info{Runtime: config.RuntimeVLLM, Models: []Model{{ID: "m1"}}})
	down := New(config.Worker{URL: "http://127.0.0.1:2"})
	reg := NewRegistry(up, down)
	if _, pending := reg.Snapshot().Candidates(config.RoleRegular, "typo"); !pending {
		t.Error("before the second worker's first answer, any model may be its")
	}
	down.noteRegistration(fmt.Errorf("%w: connection refused", ErrUnreachable))
	if _, pending := reg.Snapshot().Candidates(config.RoleRegular, "typo"); pending {
		t.Error("a worker that failed to register makes an unknown model pending (a 503 retried for as long as it is down)")
	}
}

// An SGLang prefill configured with another bootstrap port than its engine reports
// (/server_info disaggregation_bootstrap_port) is flagged at registration: a WARN naming both,
// and BootstrapMismatch (GET /workers, baton check); one configured as its engine's, or with
// none configured, is not.
func TestRegistrationFlagsAWrongSGLangBootstrapPort(t *testing.T) {
	srv := engine(t, map[string]string{"/v1/models": `{"data":[{"id":"m","owned_by":"sglang"}]}`,
		"/server_info": `{"disaggregation_mode":"prefill","disaggregation_bootstrap_port":8998}`})
	port := func(n int) *int { return &n }
	for _, c := range []struct {
		name      string
		port      *int
		mismatch  bool
		logPhrase string
	}{
		{"wrong", port(9000), true, "bootstrap_port=9000 engine_bootstrap_port=8998"},
		{"right", port(8998), false, ""},
		{"none configured", nil, false, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := New(config.Worker{URL: srv.URL, Role: config.RolePrefill, BootstrapPort: c.port})
			var log strings.Builder
			var mu sync.Mutex
			r := &Registrar{Registry: NewRegistry(w), Client: srv.Client(), Log: slog.New(slog.NewTextHandler(lockedWriter{&mu, &log}, nil)), MaxInterval: time.Second}
			r.register(context.Background(), w)
			if !w.Ready() {
				t.Fatal("not registered")
			}
			why := w.BootstrapMismatch()
			if got := why != ""; got != c.mismatch {
				t.Errorf("mismatch flagged %v (%q), want %v", got, why, c.mismatch)
			}
			mu.Lock()
			defer mu.Unlock()
			if warned := strings.Contains(log.String(), "level=WARN") && strings.Contains(log.String(), c.logPhrase); warned != c.mismatch {
				t.Errorf("WARN %v, want %v: %s", warned, c.mismatch, log.String())
			}
		})
	}
}

// An SGLang engine's /server_info max_running_requests is what it runs at once
// (Worker.MaxRunning); a worker's max_running_requests label (smg's) says it where the engine
// does not.
func TestMaxRunningFromTheEngineOrItsLabel(t *testing.T) {
	srv := engine(t, map[string]string{"/v1/models": `{"data":[{"id":"m","owned_by":"sglang"}]}`,
		"/server_info": `{"max_running_requests":48}`})
	w := New(config.Worker{URL: srv.URL})
	in, err := Detect(context.Background(), srv.Client(), w)
	if err != nil {
		t.Fatal(err)
	}
	w.SetInfo(in)
	if n := w.MaxRunning(); n != 48 {
		t.Errorf("reported: %d, want 48", n)
	}
	l := New(config.Worker{URL: "http://l:8000", Labels: map[string]string{"max_running_requests": "12"}})
	l.SetInfo(&Info{Runtime: config.RuntimeVLLM})
	if n := l.MaxRunning(); n != 12 {
		t.Errorf("labelled: %d, want 12", n)
	}
	if n := New(config.Worker{URL: "http://x:8000", Labels: map[string]string{"max_running_requests": "-3"}}).MaxRunning(); n != 0 {
		t.Errorf("a bad label: %d", n)
	}
}
