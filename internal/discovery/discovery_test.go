package discovery

import (
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/config"
)

func kubeconfig(t *testing.T, server string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	os.WriteFile(path, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "`+server+`"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u, namespace: ns}}]
current-context: x
`), 0o600)
	return path
}

// Startup fails, naming the fix, when discovery could find no worker: an invalid selector, an
// API server that does not answer, one that forbids listing pods.
func TestNewRefusesWhatWouldFindNoWorker(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	closed := "http://" + ln.Addr().String()
	ln.Close()
	forbidding := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusForbidden)
		io.WriteString(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403,"message":"pods is forbidden"}`)
	}))
	defer forbidding.Close()
	for _, c := range []struct {
		name string
		cfg  config.Config
		want string
	}{
		{"invalid selector", config.Config{ServiceDiscovery: true, Selector: map[string]string{"app": "not valid!"}, KubeConfig: kubeconfig(t, closed)}, "no valid label selector"},
		{"API server down", config.Config{ServiceDiscovery: true, Selector: map[string]string{"app": "vllm"}, KubeConfig: kubeconfig(t, closed), ServiceDiscoveryNamespace: "ns"}, "does not answer"},
		{"pods forbidden", config.Config{ServiceDiscovery: true, Selector: map[string]string{"app": "vllm"}, KubeConfig: kubeconfig(t, forbidding.URL), ServiceDiscoveryNamespace: "ns"}, "grant its service account get, list and watch on pods"},
	} {
		if _, err := New(c.cfg, nil, log); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q", c.name, err, c.want)
		}
	}
}
