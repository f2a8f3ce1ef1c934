package k8s

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/discovery"
	"github.com/baton-llm/baton/internal/epp/dataplane"
	"github.com/baton-llm/baton/internal/k8stest"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// pool writes (creates or replaces) an InferencePool.
func pool(t *testing.T, dyn dynamic.Interface, ns, name string, match map[string]string, port int) {
	t.Helper()
	ml := map[string]any{}
	for k, v := range match {
		ml[k] = v
	}
	u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": name},
		"spec": map[string]any{"selector": map[string]any{"matchLabels": ml}, "targetPorts": []any{map[string]any{"number": int64(port)}},
			"endpointPickerRef": map[string]any{"kind": "Service", "name": "baton-epp", "port": map[string]any{"number": int64(9002)}, "failureMode": "FailClose"}}}}
	ri := dyn.Resource(discovery.InferencePools).Namespace(ns)
	old, err := ri.Get(context.Background(), name, metav1.GetOptions{})
	if err == nil {
		u.SetResourceVersion(old.GetResourceVersion())
		_, err = ri.Update(context.Background(), u, metav1.UpdateOptions{FieldValidation: "Strict"})
	} else {
		_, err = ri.Create(context.Background(), u, metav1.CreateOptions{FieldValidation: "Strict"})
	}
	if err != nil {
		t.Fatal(err)
	}
}

// setStatusIP is setStatus with the pod's own IP (pods of a pool share its target port).
func setStatusIP(t *testing.T, cs kubernetes.Interface, ns, name, ip string) {
	t.Helper()
	patch := fmt.Sprintf(`{"status":{"phase":"Running","podIP":%q,"podIPs":[{"ip":%q}],"conditions":[{"type":"Ready","status":"True"}]}}`, ip, ip)
	if _, err := cs.CoreV1().Pods(ns).Patch(context.Background(), name, "application/merge-patch+json", []byte(patch), metav1.PatchOptions{}, "status"); err != nil {
		t.Fatal(err)
	}
}

// poolEngines starts n simulated engines on 127.0.0.2, .3, … sharing one port, as the pods of
// a pool share its target port.
func poolEngines(t *testing.T, n int) ([]*sim.Engine, int) {
	t.Helper()
	for try := 0; try < 20; try++ {
		ln, err := net.Listen("tcp", "127.0.0.2:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		var es []*sim.Engine
		for i := 0; i < n; i++ {
			e, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Model: "m", Host: "127.0.0." + strconv.Itoa(2+i), Port: port})
			if err != nil {
				break
			}
			es = append(es, e)
		}
		if len(es) == n {
			for _, e := range es {
				t.Cleanup(e.Close)
			}
			return es, port
		}
		for _, e := range es {
			e.Close()
		}
	}
	t.Fatal("no port free on every loopback address")
	return nil, 0
}

// The Endpoint Picker's workers are the pods its InferencePool selects, on its target port,
// watched: a pool that does not exist yet gives none (not ready); created, its ready pods join
// and requests go through the test data plane to them; a changed selector and pod churn are
// followed; a pool whose spec cannot be used, and a deleted pool, give none again.
func TestInferencePoolLifecycle(t *testing.T) {
	s := k8stest.Require(t, server)
	cs, ns := cluster(t)
	dyn := dynamic.NewForConfigOrDie(s.Config)
	k8stest.InferencePoolCRD.Install(t, dyn)
	es, port := poolEngines(t, 3)

	cfg := config.Default()
	cfg.EPP, cfg.InferencePool = true, "chat-pool"
	d := &discovery.Discovery{Client: cs, Dynamic: dyn, Pool: "chat-pool", Namespace: ns}
	g := discovering(t, cfg, d)
	grpcSrv, _ := g.NewEPP(cfg)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go grpcSrv.Serve(ln)
	t.Cleanup(grpcSrv.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	dp := &dataplane.Proxy{Picker: extprocv3.NewExternalProcessorClient(conn), Client: &http.Client{}}
	front := httptest.NewServer(dp)
	t.Cleanup(front.Close)
	ask := func() int {
		resp, err := http.Post(front.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi","max_tokens":2}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	urls := func() map[string]bool {
		out := map[string]bool{}
		for _, w := range g.Registry.Snapshot().Workers {
			if w.Ready() {
				out[w.URL] = true
			}
		}
		return out
	}
	url := func(i int) string { return "http://127.0.0." + strconv.Itoa(2+i) + ":" + strconv.Itoa(port) }

	pod(t, cs, ns, "p0", map[string]string{"app": "chat", "tier": "a"}, nil)
	pod(t, cs, ns, "p1", map[string]string{"app": "chat"}, nil)
	pod(t, cs, ns, "other", map[string]string{"app": "db"}, nil)
	setStatusIP(t, cs, ns, "p0", "127.0.0.2")
	setStatusIP(t, cs, ns, "p1", "127.0.0.3")
	setStatusIP(t, cs, ns, "other", "127.0.0.4")
	poll.Until(t, "discovery listed the pods and found no pool", func() bool {
		ok, why := g.EPPReady()
		return !ok && strings.Contains(why, "does not exist")
	})
	time.Sleep(100 * time.Millisecond) // a pod applied by mistake would have joined by now
	if n := len(g.Registry.Snapshot().Workers); n != 0 {
		t.Fatalf("without the pool: %d workers", n)
	}
	if st := ask(); st != http.StatusServiceUnavailable {
		t.Errorf("without the pool: %d, want 503", st)
	}

	pool(t, dyn, ns, "chat-pool", map[string]string{"app": "chat"}, port)
	poll.Until(t, "the pool's pods join", func() bool { u := urls(); return len(u) == 2 && u[url(0)] && u[url(1)] })
	poll.Until(t, "ready", func() bool { ok, _ := g.EPPReady(); return ok })
	for i := 0; i < 4; i++ {
		if st := ask(); st != 200 {
			t.Fatalf("through the pool: %d", st)
		}
	}
	if es[0].Stats().RequestsOK+es[1].Stats().RequestsOK != 4 || es[2].Stats().RequestsReceived != 0 {
		t.Errorf("requests: %d, %d, and %d on the pod outside the pool", es[0].Stats().RequestsOK, es[1].Stats().RequestsOK, es[2].Stats().RequestsReceived)
	}

	// The selector narrows: p1 leaves. Churn: p0 goes, p2 (tier a) comes.
	pool(t, dyn, ns, "chat-pool", map[string]string{"app": "chat", "tier": "a"}, port)
	poll.Until(t, "p1 leaves with the narrower selector", func() bool { u := urls(); return len(u) == 1 && u[url(0)] })
	pod(t, cs, ns, "p2", map[string]string{"app": "chat", "tier": "a"}, nil)
	setStatusIP(t, cs, ns, "p2", "127.0.0.4")
	deletePod(t, cs, ns, "p0")
	poll.Until(t, "p0 left, p2 joined", func() bool { u := urls(); return len(u) == 1 && u[url(2)] })
	if st := ask(); st != 200 || es[2].Stats().RequestsOK != 1 {
		t.Fatalf("after churn: %d, %d on p2", st, es[2].Stats().RequestsOK)
	}

	// A spec Baton cannot use gives no workers, and says why.
	pool(t, dyn, ns, "chat-pool", map[string]string{}, port)
	poll.Until(t, "no workers from an empty selector", func() bool { return len(urls()) == 0 })
	if p := d.PoolProblem(); !strings.Contains(p, "matchLabels is empty") {
		t.Errorf("problem: %q", p)
	}
	pool(t, dyn, ns, "chat-pool", map[string]string{"app": "chat"}, port)
	poll.Until(t, "back", func() bool { return len(urls()) == 2 })

	// Deleted: every worker leaves, not ready.
	if err := dyn.Resource(discovery.InferencePools).Namespace(ns).Delete(context.Background(), "chat-pool", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the pool's workers leave", func() bool { return len(g.Registry.Snapshot().Workers) == 0 })
	poll.Until(t, "not ready", func() bool { ok, _ := g.EPPReady(); return !ok })
	if st := ask(); st != http.StatusServiceUnavailable {
		t.Errorf("after the pool was deleted: %d", st)
	}
}
