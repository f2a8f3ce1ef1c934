package pd

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// Which PD failures count against the pair (quarantine) is the outcome table's verdict on the
// one failure type. Baton running out of its own descriptors or ports says nothing of the pair:
// it used to be a 503 minted by Baton, which the status rule took for a broken pair's.
func TestSeamFailureIsTheTablesVerdict(t *testing.T) {
	w := worker.New(config.Worker{URL: "http://decode:1", Role: config.RoleDecode})
	exhausted := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.EMFILE}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, c := range []struct {
		name string
		err  error
		seam bool
	}{
		{"Baton out of descriptors", proxy.Classify(w, LegDecode, time.Second, exhausted), false},
		{"Baton's panic", proxy.Classify(w, LegPrefill, time.Second, &proxy.PanicError{Where: "prefill_leg"}), false},
		{"decode unreachable", proxy.Classify(w, LegDecode, time.Second, refused), true},
		{"decode timed out", proxy.Classify(w, LegDecode, time.Second, context.DeadlineExceeded), true},
		{"decode answered 503", upstreamError(LegDecode, w, 503, nil, nil), true},
		{"decode answered 400", upstreamError(LegDecode, w, 400, nil, nil), false},
		{"a stream cut after its first byte", proxy.ErrAbort, true},
		{"the client left", proxy.ErrClientGone, false},
		{"a failure marked final", &outcome.Failure{Status: 502, Final: true}, true},
	} {
		if got := seamFailure(c.err); got != c.seam {
			t.Errorf("%s: seamFailure = %v, want %v", c.name, got, c.seam)
		}
	}
}

// Each handoff outcome has one class: what the recompute alert counts is only a handoff that
// should have happened and did not.
func TestHandoffClass(t *testing.T) {
	for outcome, class := range map[string]string{
		HandoffNixl: ClassHandedOff, HandoffMooncake: ClassHandedOff, HandoffBootstrap: ClassHandedOff, HandoffPassthrough: ClassHandedOff,
		HandoffRecomputed: ClassRecomputed, HandoffNoneMissing: ClassRecomputed, HandoffNoneInvalid: ClassRecomputed, HandoffNoneNoEngine: ClassRecomputed,
		HandoffNoneN: ClassByDesign, HandoffNoneBatch: ClassByDesign, HandoffNoneRoute: ClassByDesign,
		HandoffNoneFailed: ClassFailed,
	} {
		if got := HandoffClass(outcome); got != class {
			t.Errorf("%s: class %s, want %s", outcome, got, class)
		}
	}
}

// A /query answer is trusted only in the shapes vLLM's Mooncake bootstrap server gives.
func TestParseQuery(t *testing.T) {
	addr := `{"0":{"0":"10.0.0.1:7000"}}`
	for _, c := range []struct {
		body string
		ok   bool
	}{
		{`{"0":{"engine_id":"e0","worker_addr":` + addr + `},"1":{"engine_id":"e1","worker_addr":` + addr + `}}`, true},
		{`{"eng":{"0":` + addr + `,"1":` + addr + `}}`, true},
		{`{}`, false},
		{`{"0":{"engine_id":"e0"}}`, false}, // no worker_addr
		{`{"0":{"engine_id":"e0","worker_addr":{"0":{"0":"nohost"}}}}`, false}, // not host:port
		{`{"1":{"engine_id":"e1","worker_addr":` + addr + `}}`, false},         // ranks not from 0
		{`{"x":{"engine_id":"e","worker_addr":` + addr + `}}`, false},          // no rank
		{`{"prefill_dp_size":1,"prefill_tp_size":1}`, false},                   // SGLang's /route
		{`{"eng":{"0":` + addr + `},"eng2":{"0":` + addr + `}}`, false},        // rank 0 twice
	} {
		var top map[string]json.RawMessage
		if err := json.Unmarshal([]byte(c.body), &top); err != nil {
			t.Fatal(err)
		}
		if _, err := parseQuery(top); (err == nil) != c.ok {
			t.Errorf("%s: %v", c.body, err)
		}
	}
}

// A Mooncake prefill whose bootstrap port is an SGLang prefill's learns no engine id from it:
// the answer is not a vLLM Mooncake bootstrap server's (ErrNotMooncake).
func TestMooncakeBootstrapOfAnotherEngine(t *testing.T) {
	sg := engine(t, sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill})
	port := sg.BootstrapPort()
	w := worker.New(config.Worker{URL: "http://127.0.0.1:1", Role: config.RolePrefill, Runtime: config.RuntimeVLLM, KVConnector: "mooncake", BootstrapPort: &port})
	n, err := LearnEngineIDs(context.Background(), http.DefaultClient, w, "")
	if n != 0 || len(w.EngineIDs()) != 0 || !errors.Is(err, ErrNotMooncake) {
		t.Errorf("learned %d ids %v, err %v", n, w.EngineIDs(), err)
	}
	mc := engine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorMooncake, EngineID: "mc"})
	port = mc.BootstrapPort()
	w = worker.New(config.Worker{URL: "http://127.0.0.1:1", Role: config.RolePrefill, Runtime: config.RuntimeVLLM, KVConnector: "mooncake", BootstrapPort: &port})
	if n, err := LearnEngineIDs(context.Background(), http.DefaultClient, w, ""); n != 1 || err != nil || w.EngineIDs()[0] != "mc" {
		t.Errorf("a Mooncake bootstrap server: %d %v %v", n, err, w.EngineIDs())
	}
}
