package cluster

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sync"
)

// auditing, when dir is set, makes every cluster started afterwards log the
// API requests of one namespace's service accounts.
var auditing struct {
	sync.Mutex
	namespace, dir string
}

// AuditServiceAccounts makes the kube-apiserver of every cluster started
// afterwards write an audit log, at Metadata level, of the requests made by
// the service accounts of namespace: one file per cluster in dir, which
// outlives the clusters (their own dirs are removed after a passing test).
// Read them with ReadAuditEvents once the clusters have stopped.
func AuditServiceAccounts(namespace, dir string) {
	auditing.Lock()
	defer auditing.Unlock()
	auditing.namespace, auditing.dir = namespace, dir
}

// auditFlags returns the kube-apiserver flags for the audit log, writing the
// policy into the cluster's dir; none when auditing is off.
func (c *Cluster) auditFlags() ([]string, error) {
	auditing.Lock()
	namespace, dir := auditing.namespace, auditing.dir
	auditing.Unlock()
	if dir == "" {
		return nil, nil
	}
	// Only the response of each request: RequestReceived would log it twice.
	policy := fmt.Sprintf(`apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts:%s"]
- level: None
`, namespace)
	path := filepath.Join(c.dir, "audit-policy.yaml")
	if err := os.WriteFile(path, []byte(policy), 0o600); err != nil {
		return nil, fmt.Errorf("write audit policy: %w", err)
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("create audit log dir: %w", err)
	}
	return []string{
		"--audit-policy-file=" + path,
		"--audit-log-path=" + filepath.Join(dir, filepath.Base(c.dir)+".audit.log"),
		"--audit-log-format=json",
		"--audit-log-mode=blocking",
		"--audit-log-maxbackup=0",
	}, nil
}

// AuditEvent is the part of an audit.k8s.io/v1 Event that says who did what.
type AuditEvent struct {
	Stage      string `json:"stage"`
	Verb       string `json:"verb"`
	RequestURI string `json:"requestURI"`
	User       struct {
		Username string `json:"username"`
		// Extra holds a bound token's claims, e.g.
		// authentication.kubernetes.io/node-name and pod-name.
		Extra map[string][]string `json:"extra"`
	} `json:"user"`
	ObjectRef      *AuditObjectRef `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	// Annotations carry the authorizer's decision
	// ("authorization.k8s.io/decision": "allow" or "forbid").
	Annotations map[string]string `json:"annotations"`
}

// AuditObjectRef is the object a request was about.
type AuditObjectRef struct {
	APIGroup    string `json:"apiGroup"`
	Resource    string `json:"resource"`
	Subresource string `json:"subresource"`
	Namespace   string `json:"namespace"`
	Name        string `json:"name"`
}

// AuditEvents reads this cluster's audit log: empty unless
// AuditServiceAccounts was called before the cluster started.
func (c *Cluster) AuditEvents() ([]AuditEvent, error) {
	auditing.Lock()
	dir := auditing.dir
	auditing.Unlock()
	if dir == "" {
		return nil, fmt.Errorf("no audit log: AuditServiceAccounts was not called before the cluster started")
	}
	return readAuditLog(filepath.Join(dir, filepath.Base(c.dir)+".audit.log"))
}

// ReadAuditEvents reads every audit log AuditServiceAccounts had written to
// dir.
func ReadAuditEvents(dir string) ([]AuditEvent, error) {
	// Rotated files (past 100 MB) are named <name>.audit-<time>.log.
	paths, err := filepath.Glob(filepath.Join(dir, "*.audit*.log"))
	if err != nil {
		return nil, err
	}
	var events []AuditEvent
	for _, p := range paths {
		e, err := readAuditLog(p)
		if err != nil {
			return nil, err
		}
		events = append(events, e...)
	}
	return events, nil
}

func readAuditLog(p string) ([]AuditEvent, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("read audit log: %w", err)
	}
	defer func() { _ = f.Close() }()
	var events []AuditEvent
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 0, 64*1024), 4*1024*1024)
	for s.Scan() {
		var e AuditEvent
		if err := json.Unmarshal(s.Bytes(), &e); err != nil {
			return nil, fmt.Errorf("audit log %s: %w", p, err)
		}
		events = append(events, e)
	}
	if err := s.Err(); err != nil {
		return nil, fmt.Errorf("audit log %s: %w", p, err)
	}
	return events, nil
}
