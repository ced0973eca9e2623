// Lock annotations that clang checks (-Wthread-safety, on in `make sanitize`), and a mutex that
// carries them: std::mutex in libstdc++ is not annotated, so guarded state uses efdl::Mutex and
// efdl::MutexLock. With GCC the annotations compile to nothing and Mutex is a plain std::mutex.
//
//   class Queue {
//     void Push(int v) EFDL_EXCLUDES(mu_) { MutexLock lock(mu_); items_.push_back(v); }
//     void DropLocked() EFDL_REQUIRES(mu_);
//     Mutex mu_;
//     std::deque<int> items_ EFDL_GUARDED_BY(mu_);
//   };
//
// Waiting on a condition: std::condition_variable_any with the MutexLock, and a predicate lambda
// annotated EFDL_REQUIRES(mu_) (the analysis does not look into the library's wait).
#pragma once

#include <mutex>

#if defined(__clang__)
#define EFDL_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define EFDL_THREAD_ANNOTATION(x)
#endif

#define EFDL_CAPABILITY(x) EFDL_THREAD_ANNOTATION(capability(x))
#define EFDL_SCOPED_CAPABILITY EFDL_THREAD_ANNOTATION(scoped_lockable)
#define EFDL_GUARDED_BY(x) EFDL_THREAD_ANNOTATION(guarded_by(x))
#define EFDL_PT_GUARDED_BY(x) EFDL_THREAD_ANNOTATION(pt_guarded_by(x))
#define EFDL_REQUIRES(...) EFDL_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EFDL_EXCLUDES(...) EFDL_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define EFDL_ACQUIRE(...) EFDL_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define EFDL_RELEASE(...) EFDL_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define EFDL_TRY_ACQUIRE(...) EFDL_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EFDL_NO_THREAD_SAFETY_ANALYSIS EFDL_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace efdl {

// A std::mutex the analysis knows as a capability.
class EFDL_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  void lock() EFDL_ACQUIRE() { mu_.lock(); }
  void unlock() EFDL_RELEASE() { mu_.unlock(); }
  bool try_lock() EFDL_TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  std::mutex mu_;
};

// Holds a Mutex for its scope. Also a BasicLockable (lock/unlock), so that
// std::condition_variable_any can release and retake it while waiting.
class EFDL_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) EFDL_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() EFDL_RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  // For std::condition_variable_any only: it unlocks and relocks around the wait.
  void lock() EFDL_ACQUIRE() { mu_.lock(); }
  void unlock() EFDL_RELEASE() { mu_.unlock(); }

 private:
  Mutex& mu_;
};

}  // namespace efdl
